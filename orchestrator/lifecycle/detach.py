"""``orch launch ... --detach``: the launch runs in a background process of its own and the command returns.

Everything a bad input could fail on is checked here first (exit 2, nothing written), then the same ``orch
launch`` runs in a new session (``setsid``: no controlling terminal, so closing the terminal that started it
sends it no SIGHUP) with its output in ``<run dir>/orch.log``. That process is the run's supervisor: it hosts
the store and the controller as a foreground launch does, and ``orch stop`` signals it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

from orchestrator.launch_record import new_record, supervisor, write_record
from orchestrator.rundir import ORCH_LOG


def launch_detached(preset: str, overrides: Sequence[str], mode: str = "detached") -> tuple[str, str]:
    """Start ``orch launch conf=PRESET OVERRIDES`` in the background; returns (run dir, run id)."""
    from orchestrator.launch import check_launchable

    cfg, run_id = check_launchable(preset, overrides)  # the background launch runs here: its store host too
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = new_record(str(run_dir), run_id, cfg.preset, overrides, mode)  # a resume's preset is the run's own
    write_record(run_dir, record)  # before the child starts: it joins this record instead of writing its own
    argv = [sys.executable, "-m", "orchestrator.cli", "launch", f"conf={preset}", *overrides, f"run.dir={run_dir}",
            f"run.id={run_id}"]
    with (run_dir / ORCH_LOG).open("ab") as log:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=_unbuffered())
    write_record(run_dir, {**record, "supervisor": supervisor(child.pid)})
    return str(run_dir), run_id


def _unbuffered() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1"}
