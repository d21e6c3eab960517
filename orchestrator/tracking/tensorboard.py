"""TensorBoard: event files written by ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardTracker:
    """Scalars at their step; the config as one ``config`` text summary (a Markdown table) at step 0."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def log_config(self, params: dict[str, str]) -> None:
        rows = "\n".join(f"| {key} | {value} |" for key, value in params.items())
        self._writer.add_text("config", f"| key | value |\n|---|---|\n{rows}", global_step=0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def open(settings: Any, run_dir: Path, run_name: str) -> TensorBoardTracker:
    """Open a SummaryWriter in ``settings.log_dir`` (default ``<run dir>/tensorboard``)."""
    return TensorBoardTracker(str(settings.log_dir or run_dir / "tensorboard"))
