"""Where a run's checkpoints are: what ``orch ckpt list|export RUN_OR_URL`` read when handed a run dir.

A run dir (it holds ``config.yaml``) keeps its checkpoints at its config's ``checkpoint.url``, else at
``<run dir>/checkpoints``; anything else is taken as a checkpoint URL itself. HF Trainer checkpoints are under
that URL's ``hf/`` (orchestrator/checkpoint/hf_dirs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from orchestrator.rundir import CONFIG_FILE

from .hf_dirs import HF_SUBDIR


def checkpoint_url_of(run_or_url: str) -> str:
    """The checkpoint URL of a run dir (its config's ``checkpoint.url``, else ``<run dir>/checkpoints``), or
    ``run_or_url`` itself when it is not a run dir."""
    config = Path(run_or_url) / CONFIG_FILE
    if "://" in run_or_url or not config.is_file():
        return run_or_url
    url = ((yaml.safe_load(config.read_text()) or {}).get("checkpoint") or {}).get("url")
    return url or str(Path(run_or_url) / "checkpoints")


def hf_output_dir_of(url: str) -> Optional[str]:
    """The local directory where HF Trainer checkpoints of checkpoint URL ``url`` are (``<url>/hf``), or ``url``
    itself when it is such a directory already; None for a remote URL (HF saves to a filesystem only)."""
    if "://" in url and not url.startswith("file://"):
        return None
    path = Path(url.removeprefix("file://"))
    return str(path if path.name == HF_SUBDIR else path / HF_SUBDIR)
