"""The user's index of runs: every launch's run id and run dir, so ``orch status|logs|stop|resume <run id>`` find a
run from any directory, wherever its run dir is (``run.dir=/tmp/x`` included), and ``orch status`` lists them all.

One small JSON file per run under ``$XDG_STATE_HOME/orch/runs/`` (default ``~/.local/state/orch/runs/``, created
0700: run dirs and ids are the user's own business). A file per run needs no lock: launches of different runs
never write the same file, and a run launched again (``orch resume``) rewrites its own. The index only points:
the run dir's own files (``launch.json``, ``events.jsonl``) say everything else, and an entry whose run dir is gone
is skipped.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Optional

from orchestrator.rundir import write_json_atomic

STATE_ENV = "XDG_STATE_HOME"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def index_dir() -> Path:
    """``$XDG_STATE_HOME/orch/runs``, else ``~/.local/state/orch/runs``; created 0700 (its parents too)."""
    base = Path(os.environ.get(STATE_ENV) or Path.home() / ".local" / "state")
    path = base / "orch" / "runs"
    for directory in (base / "orch", path):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    return path


def _entry_path(run_id: str) -> Path:
    return index_dir() / f"{_UNSAFE.sub('_', run_id)}.json"


def register(run_id: str, run_dir: str) -> None:
    """Record that ``run_id`` lives in ``run_dir`` (absolute); a launch of the same run again refreshes it.
    Never fails a launch: an unwritable state dir only costs the lookup by id."""
    try:
        write_json_atomic(_entry_path(run_id), {"run_id": run_id, "run_dir": str(Path(run_dir).resolve()),
                                                "t": time.time()})
    except OSError:
        pass


def lookup(run_id: str) -> Optional[Path]:
    """The run dir registered for ``run_id``, None when there is none (or it is gone)."""
    try:
        entry = json.loads(_entry_path(run_id).read_text())
    except (OSError, ValueError):
        return None
    path = Path(entry.get("run_dir", ""))
    return path if entry.get("run_id") == run_id and path.is_dir() else None


def known_run_dirs() -> list[Path]:
    """Every registered run dir that still exists, newest registration first."""
    entries = []
    try:
        files = list(index_dir().glob("*.json"))
    except OSError:
        return []
    for file in files:
        try:
            entry = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        path = Path(entry.get("run_dir", ""))
        if path.is_dir():
            entries.append((entry.get("t", 0.0), path))
    return [path for _, path in sorted(entries, key=lambda e: -e[0])]
