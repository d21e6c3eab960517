"""Append-only JSON-lines files of a run dir (events.jsonl, metrics.jsonl).

Several processes (launcher, agents, workers) append to the same file: each record is written with one
``os.write`` on an ``O_APPEND`` descriptor, which keeps lines whole on a local filesystem.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"


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
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class EventLog:
    """``events.jsonl`` of one run dir: ``{"t": unix_seconds, "event": NAME, ...}`` per line."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / EVENTS_FILE

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record ``event`` now with ``fields``; returns the record written."""
        record = {"t": time.time(), "event": event, **fields}
        append_jsonl(self.path, record)
        return record

    def read(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)
