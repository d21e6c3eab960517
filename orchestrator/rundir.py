"""The run dir: its file names, the events a run records, and the one way to write and read its JSON lines.

Everything a run did is in its run dir, append-only, so a report can be rebuilt from it after a crash. Several
processes (the launcher, node agents, workers, chaos drills) append to the same files: each record is written
with one ``os.write`` on an ``O_APPEND`` descriptor, which keeps lines whole on a local filesystem.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from orchestrator.events import Event, EventName  # EventName: importable from here, as it always was

CONFIG_FILE = "config.yaml"  # the resolved config every worker loads
PLAN_FILE = "plan.json"  # the launch plan, as `orch launch --dry-run` prints it
EVENTS_FILE = "events.jsonl"  # one JSON object per event: {"t": unix seconds, "event": NAME, ...}
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged training step
SUMMARY_FILE = "summary.json"  # the outcome, derived from the two files above
NODES_FILE = "nodes.json"  # {"<node>": <torchrun agent pid>} of the live agents, read by `orch chaos`
LOGS_DIR = "logs"  # logs/node<N>.log per node agent, logs/torchrun/ per rank
NOTICES_DIR = "notices"  # notices/node<N>-<agent pid>.json: preemption notices to one agent's workers
LAUNCH_FILE = "launch.json"  # who launched the run, how, with which preset and overrides (orch resume reads it)
ORCH_LOG = "orch.log"  # a detached launch's own output (what `orch launch` prints in the foreground)
SAMPLES_DIR = "samples"  # samples/rank<R>.jsonl: sample ids per step (trainer.record_samples)
HEARTBEATS_DIR = "heartbeats"  # heartbeats/node<N>-rank<R>.json: each worker's liveness (hang detection)
STACKS_DIR = "stacks"  # stacks/node<N>-rank<R>.txt: a worker's Python stacks, written on STACK_SIGNAL
STACK_SIGNAL = signal.SIGUSR2  # asks a worker's faulthandler for its stacks


def heartbeat_name(node: int, rank: int) -> str:
    """A worker's file name (without suffix) under HEARTBEATS_DIR and STACKS_DIR."""
    return f"node{node}-rank{rank}"


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON object as one line, atomically with respect to other appenders."""
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a torn last line from a crash is skipped); [] if absent."""
    return list(_iter_jsonl(Path(path)))


def _iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    # Bytes, not text: one line of binary garbage (a foreign writer, a torn disk block) is skipped like a torn
    # line instead of ending every reader with a UnicodeDecodeError.
    if not path.exists():
        return
    with path.open("rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                yield record


def check_events(path: str | os.PathLike) -> None:
    """UserError (exit 2) naming the first line of an events file that is not an event: not UTF-8 JSON, not
    an object, or without ``"event"`` (a torn last line, left by a crash, is not an error). For commands that
    read a run dir a person hands them; the run's own readers skip such lines."""
    from orchestrator.errors import UserError

    lines = Path(path).read_bytes().split(b"\n")
    for number, line in enumerate(lines, 1):
        last = number == len(lines) or (number == len(lines) - 1 and not lines[-1])
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = None if isinstance(record, dict) and isinstance(record.get("event"), str) else 'has no "event"'
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problem = "is not UTF-8 JSON" if isinstance(e, UnicodeDecodeError) else "is not JSON"
            if last and isinstance(e, json.JSONDecodeError):
                continue
        if problem:
            raise UserError(f"{path} line {number} {problem}: {line[:60]!r}. Fix: remove or repair that line "
                            "(each line is one JSON event written by orch)")


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Write ``value`` as JSON through a temporary file and a rename: readers see the old or the new, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value) + "\n")
    tmp.replace(path)


class JsonlTail:
    """The complete JSON lines appended to ``path`` since the previous :meth:`read_new` (a line still being
    written waits for the next call; a torn line is skipped as :func:`read_jsonl` skips it)."""

    def __init__(self, path: str | os.PathLike, from_end: bool = True):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                if line.strip():
                    records.append(json.loads(line))
            except ValueError:
                continue
        return records


class EventLog:
    """``events.jsonl`` of one run dir: ``{"t": unix_seconds, "event": NAME, ...}`` per line."""

    def __init__(self, run_dir: str | os.PathLike, clock: Callable[[], float] = time.time):
        self.path = Path(run_dir) / EVENTS_FILE
        self.clock = clock  # wall time; tests of the controller inject theirs

    def write(self, event: Event, t: Optional[float] = None) -> dict[str, Any]:
        """Record ``event`` (a constructor of :mod:`orchestrator.events`) at ``t`` (default now: a fault a
        drill logged keeps its own time); returns the record written."""
        record = {"t": self.clock() if t is None else t, "event": str(event.event), **event.fields()}
        append_jsonl(self.path, record)
        return record

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record a hand-made event ``event`` with free ``fields`` (tests and drills that write partial records
        on purpose); orch's own writers use :meth:`write`. Returns the record written."""
        record = {"t": self.clock(), "event": str(event), **fields}
        append_jsonl(self.path, record)
        return record

    def read(self) -> list[dict[str, Any]]:
        """Every record (:func:`orchestrator.events.parse` gives one's typed event)."""
        return read_jsonl(self.path)

    def tail(self, from_end: bool = True) -> JsonlTail:
        return JsonlTail(self.path, from_end)


def latest_launch(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the most recent ``launch_started`` on (a run dir may be launched again to resume)."""
    starts = [i for i, e in enumerate(events) if e.get("event") == EventName.LAUNCH_STARTED]
    return events[starts[-1]:] if starts else events
