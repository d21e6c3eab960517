"""``orch logs``, ``orch stop`` and ``orch resume``: act on a run found by ``runs.find_run``.

Stopping is graceful: the run's supervisor gets ``STOP_SIGNAL`` (a Ray job: the Jobs API's stop), every node
gets a preemption notice, the workers save an emergency checkpoint and leave, and the run ends ``stopped``.
``orch resume`` launches the recorded preset and overrides again into the same run dir, which resumes from its
newest checkpoint (``checkpoint.resume=auto``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from orchestrator.errors import UserError
from orchestrator.lifecycle.runs import LIVE, current_events, own_run, stale_error, status_of
from orchestrator.rundir import LOGS_DIR, ORCH_LOG, EventName

FOLLOW_POLL_S = 0.5


def _log_files(run_dir: Path, record: dict[str, Any], node: Optional[int]) -> list[Path]:
    """The newest attempt's logs: a detached one's ``orch.log`` (everything it printed, node lines included),
    else the node logs."""
    if node is not None:
        return [run_dir / LOGS_DIR / f"node{node}.log"]
    if record.get("mode") == "detached" and (run_dir / ORCH_LOG).is_file():
        return [run_dir / ORCH_LOG]
    return sorted((run_dir / LOGS_DIR).glob("node*.log"))


def show_logs(ref: str, follow: bool, node: Optional[int], write: Callable[[str], None]) -> None:
    """Print RUN's log (``--node N``: that node's); ``follow``: keep printing until the run has ended."""
    run_dir, record = own_run(ref, "show the logs of")
    if record.get("ray_job") and node is None:
        from orchestrator.lifecycle import rayjobs

        if follow:
            rayjobs.follow_job_logs(record, write)
        else:
            write(rayjobs.job_logs(record))
        return
    files = _log_files(run_dir, record, node)
    if not any(f.is_file() for f in files) and not (follow and status_of(run_dir, record).state in LIVE):
        which = f"node {node}" if node is not None else "the run"
        raise UserError(f"run {ref!r} has no log for {which} yet ({', '.join(str(f) for f in files) or LOGS_DIR}). "
                        "Fix: see the nodes in `orch status`; node logs appear once its agents started")
    starts = record.get("log_offsets") or {}  # where this attempt's part of each log begins
    offsets: dict[Path, int] = {}
    while True:
        live = follow and status_of(run_dir, record).state in LIVE
        for f in _log_files(run_dir, record, node):  # node logs appear as their agents start
            offsets.setdefault(f, starts.get(f.name, 0))
            try:
                with f.open("rb") as stream:
                    stream.seek(offsets[f])
                    data = stream.read()
            except FileNotFoundError:
                continue
            offsets[f] += len(data)
            if data:
                write(data.decode(errors="replace"))
        if not live:
            return
        time.sleep(FOLLOW_POLL_S)


def stop_run(ref: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Stop RUN gracefully and wait for its end; returns its summary. A run that is not running is refused."""
    run_dir, record = own_run(ref, "stop")
    view = status_of(run_dir, record)
    if view.state == "stale":
        raise stale_error(ref, view)
    if view.state not in LIVE:
        raise UserError(f"run {ref!r} is not running: it ended {view.state}. Fix: `orch resume {ref}` launches it again")
    if record.get("ray_job"):
        from orchestrator.lifecycle import rayjobs

        rayjobs.stop_job(record)
        rayjobs.wait_job(record, timeout_s)
    else:
        from orchestrator.controller.controller import STOP_SIGNAL

        os.kill(record["supervisor"]["pid"], STOP_SIGNAL)
        deadline = time.monotonic() + timeout_s
        while status_of(run_dir, record).state in LIVE and time.monotonic() < deadline:
            time.sleep(0.5)
    view = status_of(run_dir, record)
    if view.state in LIVE:
        raise UserError(f"run {ref!r} did not end within {timeout_s:.0f} s of the stop request. Fix: `orch logs {ref}` "
                        "shows what it is doing; `orch chaos kill-node` ends a node that hangs")
    saved = [e for e in current_events(run_dir, record) if e["event"] == EventName.EMERGENCY_CHECKPOINT]
    return {"state": view.state, "step": view.step, "emergency_checkpoint": saved[-1] if saved else None,
            "run_dir": str(run_dir), "run_id": view.run_id}


def resume_args(ref: str, extra: Sequence[str]) -> tuple[str, list[str]]:
    """The preset and overrides to launch RUN again with: the recorded ones, then ``extra``, then its run dir.
    A run still running, or one launched from Python without a command line, is refused."""
    from orchestrator.config.compose import split_preset
    from orchestrator.launch_record import merge_overrides

    run_dir, record = own_run(ref, "resume")
    if status_of(run_dir, record).state in LIVE:
        raise UserError(f"run {ref!r} is still running. Fix: `orch stop {ref}` first, or `orch status {ref}`")
    if record.get("overrides") is None:
        raise UserError(f"run {ref!r} was launched from Python with a composed config: its overrides are not "
                        f"recorded. Fix: launch it again with orch launch conf=... run.dir={run_dir}")
    if any(t.startswith("conf=") for t in extra):
        preset, extra = split_preset(extra)
        if preset != record["preset"]:
            raise UserError(f"conf={preset}: run {ref!r} was launched with conf={record['preset']}. Fix: leave conf= out")
    overrides = merge_overrides(record["overrides"], [o for o in extra if not o.startswith(("run.dir=", "run.id="))])
    # The same run id: the tracker runs (MLflow's, W&B's) and the index go on with it.
    return record["preset"], overrides + [f"run.dir={run_dir}", f"run.id={record['run_id']}"]
