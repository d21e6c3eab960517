"""Weights & Biases: a ``wandb`` run, offline by default (``wandb sync DIR`` uploads it later)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbTracker:
    """The config as the run's config; metrics per step. ``wandb.init`` gets an explicit config only."""

    def __init__(self, project: str, mode: str, directory: str, run_name: str):
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True, console="off", save_code=False)
        self.dir = directory
        # group: the W&B runs of one orch run (one per worker restart) show together.
        self._run = wandb.init(project=project, mode=mode, dir=directory, name=run_name, group=run_name,
                               settings=settings, reinit="create_new")

    def log_config(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() returns before wandb's service has written the run file; teardown waits for it, so the
        # offline run is complete on disk when close returns (a worker killed right after loses nothing).
        wandb.teardown()


def open(settings: Any, run_dir: Path, run_name: str) -> WandbTracker:
    """Open a run in ``settings.project``; files under ``settings.dir`` (default ``<run dir>``, so ``<run dir>/wandb``)."""
    return WandbTracker(settings.project, settings.mode, str(settings.dir or run_dir), run_name)
