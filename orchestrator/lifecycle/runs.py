"""Find a run again and say where it stands: ``orch status [RUN]``.

RUN is a run dir (a path), a run id (``cpu-gloo-20261130151151-6b4ba4``, found in the user's index of runs from
any directory: orchestrator/run_index.py) or a name under ``runs/`` (``cpu_gloo/20261130-151151-1a2b``). A run's
state comes from its own files: ``run_finished`` in ``events.jsonl`` says how it ended; before that it is
``starting`` or ``running`` while its supervising process (``launch.json``) is alive, or its Ray job runs, and
``stale`` once that is gone without an end recorded.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orchestrator import run_index
from orchestrator.errors import UserError
from orchestrator.launch_record import read_record
from orchestrator.rundir import EVENTS_FILE, LAUNCH_FILE, METRICS_FILE, ORCH_LOG, EventName, read_jsonl

RUNS_ROOT = "runs"  # where launches without run.dir= go (launch.resolve_run_dir), relative to the current dir
LIVE = ("starting", "running")


@dataclass
class RunStatusView:
    """One run as ``orch status`` shows it."""

    run_dir: str
    record: dict[str, Any]
    state: str  # starting, running, stale, or run_finished's status (succeeded, failed, stopped, ...)
    world_size: Optional[int]
    step: Optional[int]
    goodput: Optional[float]
    last_event: Optional[dict[str, Any]]

    @property
    def run_id(self) -> str:
        return self.record.get("run_id", Path(self.run_dir).name)

    def lines(self) -> str:
        from orchestrator.report.progress import describe_event

        last = self.last_event
        rows = [("run", self.run_id), ("run dir", self.run_dir), ("state", self.state),
                ("launched", f"{self.record.get('mode', '?')} by {self.record.get('user', '?')} on "
                             f"{self.record.get('host', '?')}, conf={self.record.get('preset')} "
                             f"{' '.join(self.record.get('overrides') or [])}".rstrip()),
                ("world size", _or_dash(self.world_size)), ("step", _or_dash(self.step)),
                ("goodput", "-" if self.goodput is None else f"{self.goodput:.1%}"),
                ("last event", f"{describe_event(last)} {time.time() - last['t']:.0f} s ago" if last else "-")]
        cause = root_cause(self.run_dir) if self.state == "failed" else None
        if cause:
            rows.insert(3, ("root cause", cause))
        if self.record.get("attempt", 1) > 1:
            rows.insert(3, ("attempt", str(self.record["attempt"])))
        if self.record.get("ray_job"):
            rows.insert(4, ("ray job", f"{self.record['ray_job']['submission_id']} at {self.record['ray_job']['address']}"))
        return "\n".join(f"{k + ':':<12} {v}" for k, v in rows)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def find_run(ref: str) -> Path:
    """The run dir RUN names, or UserError (exit 2) saying none was found."""
    path = Path(ref)
    if (path / LAUNCH_FILE).is_file() or (path / EVENTS_FILE).is_file():
        return path.resolve()
    if (Path(RUNS_ROOT) / ref / LAUNCH_FILE).is_file():
        return (Path(RUNS_ROOT) / ref).resolve()
    indexed = run_index.lookup(ref)
    if indexed is not None and (indexed / LAUNCH_FILE).is_file():
        return indexed.resolve()
    for record_path in Path(RUNS_ROOT).glob(f"*/*/{LAUNCH_FILE}"):
        record = read_record(record_path.parent)
        if record and record.get("run_id") == ref:
            return record_path.parent.resolve()
    raise UserError(f"run {ref!r} not found: no run dir at that path, under {RUNS_ROOT}/, or with that run id in "
                    f"{run_index.index_dir()}. Fix: give the run dir `orch launch` printed, or see `orch status` "
                    "for every run you launched")


def own_run(ref: str, act: str) -> tuple[Path, dict[str, Any]]:
    """The run dir and record of RUN, refused (exit 2) when it has no record or another user launched it."""
    run_dir = find_run(ref)
    record = read_record(run_dir)
    if record is None:
        raise UserError(f"run {ref!r} has no {LAUNCH_FILE} (launched by an older orch, or not a run dir): cannot "
                        f"{act} it. Fix: launch it again with `orch launch ... run.dir={run_dir}`")
    if record.get("uid") != os.getuid():
        raise UserError(f"run {ref!r} was launched by user {record.get('user')!r}, not you: cannot {act} it. "
                        f"Fix: ask {record.get('user')} (or run orch as that user)")
    return run_dir, record


def supervisor_alive(record: dict[str, Any]) -> bool:
    """Whether the process recorded as the run's supervisor still runs on this host (a reused PID is not it)."""
    import psutil

    sup = record.get("supervisor")
    if not sup or sup.get("host") != socket.gethostname():
        return False
    try:
        process = psutil.Process(sup["pid"])
        return abs(process.create_time() - sup["create_time"]) < 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def current_events(run_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of the launch the record describes (a run dir launched again holds older ones too)."""
    since = record.get("t", 0.0)
    return [e for e in read_jsonl(run_dir / EVENTS_FILE) if e.get("t", 0.0) >= since]


def run_state(run_dir: Path, record: dict[str, Any], events: list[dict[str, Any]]) -> str:
    finished = next((e for e in reversed(events) if e["event"] == EventName.RUN_FINISHED), None)
    if finished:
        return str(finished["status"])
    if record.get("ray_job"):
        from orchestrator.lifecycle.rayjobs import job_state

        alive = job_state(record) in LIVE
    else:
        alive = supervisor_alive(record)
    if not alive:
        return "stale"
    return "running" if any(e["event"] == EventName.LAUNCH_STARTED for e in events) else "starting"


def status_of(run_dir: Path, record: dict[str, Any]) -> RunStatusView:
    """Where the run stands now: state, world size, step, goodput so far and the last event."""
    from orchestrator.report.goodput import compute_goodput

    events = current_events(run_dir, record)
    state = run_state(run_dir, record, events)
    metrics = [m for m in read_jsonl(run_dir / METRICS_FILE) if m.get("t", 0.0) >= record.get("t", 0.0)]
    world = next((e.get("world_size") for e in reversed(events) if e["event"] == EventName.RENDEZVOUS_COMPLETE), None)
    step = metrics[-1]["step"] if metrics else None
    so_far = events if state not in LIVE else events + [{"t": time.time(), "event": EventName.RUN_FINISHED}]
    goodput = (compute_goodput(so_far, metrics) or {}).get("goodput") if events else None
    return RunStatusView(str(run_dir), record, state, world, step, goodput, events[-1] if events else None)


def stale_error(ref: str, view: RunStatusView) -> UserError:
    from orchestrator.report.progress import describe_event

    last = f"last event {describe_event(view.last_event)}" if view.last_event else "no event recorded"
    log = Path(view.run_dir) / ORCH_LOG
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
    said = f"; it last said: {tail[0].strip()[:200]}" if tail else ""
    return UserError(f"run {ref!r} is stale: its orch process is gone and it never recorded an end ({last}{said}). "
                     f"Fix: `orch logs {ref}` shows its output; `orch resume {ref}` launches it again")


def run_status(ref: str) -> RunStatusView:
    """``orch status RUN``: a stale run is an error (exit 2) naming what to do."""
    run_dir, record = own_run(ref, "show")
    view = status_of(run_dir, record)
    if view.state == "stale":
        raise stale_error(ref, view)
    return view


def root_cause(run_dir: str) -> Optional[str]:
    """A failed run's root cause in one line, from its ``summary.json`` (the earliest failing rank's error, else the
    controller's reason); None when it names none."""
    import json

    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    cause = summary.get("root_cause") or {}
    if cause.get("error"):
        who = f"rank {cause['rank']}" if cause.get("rank") is not None else f"node {cause.get('node')}"
        return f"{who}: {str(cause['error']).strip().splitlines()[-1][:160]}" if str(cause["error"]).strip() else who
    reason = summary.get("failure_reason")
    return str(reason).splitlines()[0][:160] if reason else None


def status_table(root: str = RUNS_ROOT) -> str:
    """``orch status``: every run the user launched (the index of runs) and every run under ``runs/`` here, newest
    first, as a table; a failed run's root cause under its row."""
    dirs = {d.resolve() for d in run_index.known_run_dirs()}
    dirs.update(p.parent.resolve() for p in Path(root).glob(f"*/*/{LAUNCH_FILE}"))
    views = []
    for run_dir in dirs:
        record = read_record(run_dir)
        if record is not None and record.get("uid", os.getuid()) == os.getuid():
            views.append(status_of(run_dir, record))
    from orchestrator.checkpoint.inspect import _table  # the CLI's plain text tables

    if not views:
        return (f"no runs: none launched by you (index: {run_index.index_dir()}) and none under "
                f"{Path(root).resolve()}")
    views.sort(key=lambda v: -v.record.get("t", 0.0))
    header = ("RUN", "STATE", "WORLD", "STEP", "GOODPUT", "LAST EVENT", "RUN DIR")
    rows = [(v.run_id, v.state, _or_dash(v.world_size), _or_dash(v.step),
             "-" if v.goodput is None else f"{v.goodput:.1%}",
             v.last_event["event"] if v.last_event else "-", v.run_dir) for v in views]
    table = _table([header, *rows]).splitlines()
    out = table[:1]
    for view, line in zip(views, table[1:]):
        out.append(line)
        cause = root_cause(view.run_dir) if view.state == "failed" else None
        if cause:
            out.append(f"  root cause: {cause}")
    return "\n".join(out)
