"""``launch.json``: who launched a run, how, with which preset and command-line overrides, and which process
supervises it. ``orch resume`` launches the recorded preset and overrides again; ``orch status``/``stop`` find
the supervising process (or the Ray job) through it.

The process that got the user's command line writes the record; a process orch started for that launch (a
detached launch's background process, a Ray job's driver) finds a record with its run id and no other supervisor
and only adds itself as the supervisor, so the user's overrides (not the ones orch added) stay recorded. A run
launched again under its own id (``orch resume``) gets a new record, its ``attempt`` one more: ``t`` (where the
attempt's events start) and ``log_offsets`` (where its part of ``orch.log`` and of each node log starts) are that
attempt's.

Every record written also registers the run in the user's index (orchestrator/run_index.py).
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from orchestrator.run_index import register
from orchestrator.rundir import LAUNCH_FILE, LOGS_DIR, ORCH_LOG, write_json_atomic

PER_LAUNCH_KEYS = ("run.dir", "run.id")  # set by orch for each launch of a run: never recorded as overrides


def recordable(overrides: Sequence[str]) -> list[str]:
    """The overrides that define the run: all but ``run.dir``/``run.id`` (a resume sets them itself)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in PER_LAUNCH_KEYS]


def merge_overrides(recorded: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``recorded`` then ``extra``, a recorded override dropped where ``extra`` sets the same key again."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in extra}
    return [o for o in recorded if o.lstrip("+~").split("=", 1)[0] not in keys] + list(extra)


def supervisor(pid: Optional[int] = None) -> dict[str, Any]:
    """This process (or ``pid``) as a run's supervisor: PID, host and start time (a reused PID is not it)."""
    import psutil

    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "create_time": psutil.Process(pid).create_time()}


def new_record(run_dir: str, run_id: str, preset: str, overrides: Optional[Sequence[str]], mode: str,
               **extra: Any) -> dict[str, Any]:
    """A fresh record. ``overrides``: None when the run was launched from Python with a composed config (its
    overrides are unknown, so it cannot be resumed). ``mode``: foreground, detached or ray_job."""
    previous = read_record(run_dir)
    attempt = previous.get("attempt", 1) + 1 if previous and previous.get("run_id") == run_id else 1
    logs = [Path(run_dir) / ORCH_LOG, *sorted((Path(run_dir) / LOGS_DIR).glob("node*.log"))]
    return {"run_id": run_id, "run_dir": run_dir, "preset": preset,
            "overrides": None if overrides is None else recordable(overrides), "mode": mode, "t": time.time(),
            "attempt": attempt, "log_offsets": {f.name: f.stat().st_size for f in logs if f.is_file()},
            "user": getpass.getuser(), "uid": os.getuid(), "host": socket.gethostname(), **extra}


def read_record(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    import json

    path = Path(run_dir) / LAUNCH_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_record(run_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write ``launch.json`` and register the run (id -> run dir) in the user's index."""
    write_json_atomic(Path(run_dir) / LAUNCH_FILE, record)
    register(record["run_id"], str(run_dir))


def record_launch(run_dir: str, run_id: str, preset: str, overrides: Optional[Sequence[str]]) -> None:
    """Called by every launch once its checks passed: record it, or join the record orch wrote for it (the
    run's id, and no supervisor yet or this process named as it)."""
    record = read_record(run_dir)
    mine = record is not None and record.get("run_id") == run_id and (
        (record.get("supervisor") or {}).get("pid") in (None, os.getpid()))
    if not mine:
        record = new_record(run_dir, run_id, preset, overrides, "foreground")
    write_record(run_dir, {**record, "supervisor": supervisor()})
