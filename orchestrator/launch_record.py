"""``launch.json``: who launched a run, how, with which preset and command-line overrides, and which process
supervises it. ``orch resume`` launches the recorded preset and overrides again; ``orch status``/``stop`` find
the supervising process (or the Ray job) through it.

The process that got the user's command line writes the record; a process orch started for that launch (a
detached launch's background process, a Ray job's driver) finds a record with its run id and only adds itself
as the supervisor, so the user's overrides (not the ones orch added) stay recorded.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from orchestrator.rundir import LAUNCH_FILE, write_json_atomic

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
    return {"run_id": run_id, "run_dir": run_dir, "preset": preset,
            "overrides": None if overrides is None else recordable(overrides), "mode": mode, "t": time.time(),
            "user": getpass.getuser(), "uid": os.getuid(), "host": socket.gethostname(), **extra}


def read_record(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    import json

    path = Path(run_dir) / LAUNCH_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_record(run_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    write_json_atomic(Path(run_dir) / LAUNCH_FILE, record)


def record_launch(run_dir: str, run_id: str, preset: str, overrides: Optional[Sequence[str]]) -> None:
    """Called by every launch once its checks passed: record it, or join the record orch wrote for it."""
    record = read_record(run_dir)
    if record is None or record.get("run_id") != run_id:
        record = new_record(run_dir, run_id, preset, overrides, "foreground")
    write_record(run_dir, {**record, "supervisor": supervisor()})
