"""Weights & Biases: a ``wandb`` run, offline by default (``wandb sync DIR`` uploads it later)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


class WandbTracker:
    """The config as the run's config; metrics per step. ``wandb.init`` gets an explicit config only."""

    def __init__(self, project: str, mode: str, directory: str, run_name: str):
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True, console="off", save_code=False)
        self.dir = directory
        # One orch run is one W&B run: its id comes from the orch run id, and a worker restart or an `orch resume`
        # (the same run id) goes on with it (resume="allow").
        self.id = wandb_id(run_name)
        self._run = wandb.init(project=project, mode=mode, dir=directory, name=run_name, group=run_name,
                               id=self.id, resume="allow", settings=settings, reinit="create_new")

    def log_config(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_summary(self, step: int, metrics: dict[str, float], files: list[Path], status: str) -> None:
        import wandb

        self._run.summary.update({**metrics, "status": status})
        artifact = wandb.Artifact(f"run-{self.id}", type="orch-run")
        for path in files:
            artifact.add_file(str(path))
        self._run.log_artifact(artifact)
        self._exit_code = 0 if status == "succeeded" else 1

    def close(self) -> None:
        import wandb

        self._run.finish(exit_code=getattr(self, "_exit_code", None))
        # finish() returns before wandb's service has written the run file; teardown waits for it, so the
        # offline run is complete on disk when close returns (a worker killed right after loses nothing).
        wandb.teardown()


def wandb_id(run_name: str) -> str:
    """A W&B run id for an orch run id: W&B refuses ``/\\#?%:`` and ids over 64 characters."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", run_name)[-64:]


def open(settings: Any, run_dir: Path, run_name: str) -> WandbTracker:
    """Open a run in ``settings.project``; files under ``settings.dir`` (default ``<run dir>``, so ``<run dir>/wandb``)."""
    return WandbTracker(settings.project, settings.mode, str(settings.dir or run_dir), run_name)
