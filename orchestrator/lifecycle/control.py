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


RECORDED_CONF = ".orch-conf"
"""Under the run dir: the run's own config.yaml as a preset (``resume-<run id>.yaml``), which ``orch resume``
composes from."""


def resume_args(ref: str, extra: Sequence[str]) -> tuple[str, list[str], Optional[Path]]:
    """What to launch RUN again with: a preset, the overrides (the recorded ones, then ``extra``, then its run dir and
    run id) and the directory holding that preset. The preset is the run's own ``config.yaml``
    (:func:`recorded_preset`): exactly what ran, with no need of the preset directory it came from; a run dir
    without one (an older orch) gets its recorded preset, composed again. A run still running is refused."""
    from orchestrator.config.compose import split_preset
    from orchestrator.launch_record import merge_overrides
    from orchestrator.rundir import CONFIG_FILE

    run_dir, record = own_run(ref, "resume")
    if status_of(run_dir, record).state in LIVE:
        raise UserError(f"run {ref!r} is still running. Fix: `orch stop {ref}` first, or `orch status {ref}`")
    if any(t.startswith("conf=") for t in extra):
        preset, extra = split_preset(extra)
        if preset != record["preset"]:
            raise UserError(f"conf={preset}: run {ref!r} was launched with conf={record['preset']}. Fix: leave conf= out")
    extra = [o for o in extra if not o.startswith(("run.dir=", "run.id="))]
    handles = [f"run.dir={run_dir}", f"run.id={record['run_id']}"]  # the same run id: its tracker runs go on
    if not (run_dir / CONFIG_FILE).is_file() or record.get("ray_job"):  # a Ray job composes on its cluster
        if record.get("overrides") is None:
            raise UserError(f"run {ref!r} was launched from Python and has no {CONFIG_FILE}: nothing says what it "
                            f"ran. Fix: launch it again with orch launch conf=... run.dir={run_dir}")
        return record["preset"], merge_overrides(record["overrides"], extra) + handles, None
    recorded = record.get("overrides") or []
    # A group choice of the command line is made again where its option is still found (then the override applies,
    # and stays recorded); one from a preset directory that is gone is in config.yaml's values already.
    chosen = {_key(o): o.split("=", 1)[1] for o in recorded if _is_group(o) and _findable(o)}
    for o in extra:
        if _is_group(o) and chosen.get(_key(o)) != o.split("=", 1)[1]:
            raise UserError(f"{o}: run {ref!r} resumes from its recorded config.yaml, where another config group "
                            f"option cannot be chosen. Fix: set the group's keys instead ({_key(o)}.KEY=VALUE), or "
                            "launch a new run")
    kept = [o for o in recorded if not o.startswith("~")]  # a recorded deletion is done in config.yaml
    overrides = [_on_recorded(o) for o in merge_overrides(kept, extra) if not _is_group(o) or _key(o) in chosen]
    return f"resume-{record['run_id']}", overrides + handles, recorded_preset(run_dir, record["run_id"], chosen)


def recorded_preset(run_dir: Path, run_id: str, groups: dict[str, str]) -> Path:
    """A preset directory holding ``resume-<run id>.yaml``: the run's resolved ``config.yaml`` over orch's typed
    schema, after the config groups its command line chose (so those overrides still apply; ``config.yaml``, last,
    holds every value as it ran: a recorded ``key=value`` sets what it already holds)."""
    from orchestrator.rundir import CONFIG_FILE

    directory = run_dir / RECORDED_CONF
    directory.mkdir(exist_ok=True)
    chosen = "".join(f"  - {key}: {value}\n" for key, value in groups.items())
    (directory / f"resume-{run_id}.yaml").write_text(
        f"# orch resume: run {run_id}'s config.yaml as its preset\ndefaults:\n  - _orch_schema_typed\n{chosen}"
        f"  - _self_\n" + (run_dir / CONFIG_FILE).read_text())
    return directory


def _on_recorded(override: str) -> str:
    """``override`` as it applies on the recorded config, which holds what it added already: a group choice
    plainly (it is in the defaults list), ``+key=value`` as ``++key=value`` (set, added or not)."""
    if _is_group(override):
        return override.lstrip("+")
    return "+" + override if override.startswith("+") and not override.startswith("++") else override


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _is_group(override: str) -> bool:
    from orchestrator.config.compose import list_groups

    return "=" in override and _key(override) in list_groups()


def _findable(override: str) -> bool:
    """Every option a group override names (``logger=[tensorboard,mlflow]``: both) is found now."""
    from orchestrator.config.compose import list_groups

    options = override.split("=", 1)[1].strip("[]").split(",")
    return all(o.strip() in list_groups()[_key(override)] for o in options)
