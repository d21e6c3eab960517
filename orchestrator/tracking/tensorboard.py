"""TensorBoard: event files written by ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardTracker:
    """Scalars at their step; the config as one ``config`` text summary (a Markdown table) at step 0; at the end
    the config as hparams with the final figures, and a ``summary`` text."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)
        self._params: dict[str, str] = {}

    def log_config(self, params: dict[str, str]) -> None:
        self._params = dict(params)
        rows = "\n".join(f"| {key} | {value} |" for key, value in params.items())
        self._writer.add_text("config", f"| key | value |\n|---|---|\n{rows}", global_step=0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_summary(self, step: int, metrics: dict[str, float], files: list[Path], status: str) -> None:
        rows = "\n".join(f"| {key} | {value:g} |" for key, value in metrics.items())
        files_line = ", ".join(p.name for p in files)
        self._writer.add_text("summary", f"status: **{status}**; files: {files_line}\n\n| figure | value |\n"
                                         f"|---|---|\n{rows}", global_step=step)
        # hparams (and the final figures as scalars) in this directory (run_name "."), not a new timestamped one:
        # one orch run is one TensorBoard run
        self._writer.add_hparams(self._params or {"status": status}, metrics, run_name=".", global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def open(settings: Any, run_dir: Path, run_name: str) -> TensorBoardTracker:
    """Open a SummaryWriter in ``settings.log_dir`` (default ``<run dir>/tensorboard``)."""
    return TensorBoardTracker(str(settings.log_dir or run_dir / "tensorboard"))
