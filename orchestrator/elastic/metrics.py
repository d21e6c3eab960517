"""A session's step metrics: one ``metrics.jsonl`` record per logged step (rank 0), the same record to the
experiment trackers, and a progress line on stdout.

A record covers a *window*: the steps since the previous record. Its ``samples_per_s`` and ``step_time_s``
are means over that window (orchestrator/report/efficiency.py rebuilds totals from them), ``loss`` and any
extra metrics are means over the job's ranks of the logged step (the process group's all-reduce, then the
fault-tolerance mode's mean over what the process group does not span: the other replica groups), ``timing`` is the step timer's per-phase breakdown
(orchestrator/runtime/timing.py), when one is used. The all-reduce runs only on logging steps, which every
rank agrees on (``step % log_every == 0`` or the last step), to keep the loop lean.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from orchestrator.elastic import collectives
from orchestrator.rundir import METRICS_FILE, append_jsonl
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.timing import StepTimer, with_other

RECORD_KEYS = ("t", "step", "loss", "lr", "world_size", "samples_per_s", "step_time_s", "last_step_time_s",
               "restart_count", "timing", "grad_scale")


class MetricsLog:
    """Windows of steps -> records. ``run_dir`` None: nothing is written (the line is still printed).
    ``trackers``: rank 0's experiment trackers (``log_metrics(step, metrics)``), or None. ``across``: the
    process group's means -> the job's (the fault-tolerance mode's; identity where the group spans the job)."""

    def __init__(self, run_dir: Optional[str], ctx: DistContext, device: torch.device, timer: StepTimer,
                 max_steps: int, log_every: int, trackers: Any = None,
                 across: Callable[[torch.Tensor], torch.Tensor] = lambda means: means):
        self.path = Path(run_dir) / METRICS_FILE if run_dir is not None else None
        self.ctx, self.device, self.timer, self.trackers = ctx, device, timer, trackers
        self.across = across
        self.max_steps, self.log_every = max_steps, log_every
        self.last_loss: Optional[float] = None
        self.window_loaded = False
        """The open window came from elsewhere (:meth:`load_window_state`): keep it rather than start afresh."""
        self.start()

    def start(self) -> None:
        """A window starts now (the first step of this attempt starts next)."""
        self.window_start, self.window_steps, self.window_samples = time.perf_counter(), 0, 0

    def window_state(self) -> dict[str, Any]:
        """The open window, in wall time (a group that heals from a peer takes it over, so the run's records stay
        contiguous when their writer changes to a worker that was not there at the last record)."""
        return {"start_t": time.time() - (time.perf_counter() - self.window_start), "steps": self.window_steps,
                "samples": self.window_samples}

    def load_window_state(self, state: dict[str, Any]) -> None:
        self.window_start = time.perf_counter() - (time.time() - state["start_t"])
        self.window_steps, self.window_samples = state["steps"], state["samples"]
        self.window_loaded = True

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def step_done(self, step: int, samples: int, step_time_s: float, loss: Any = None,
                  extra: Optional[Mapping[str, Any]] = None,
                  fields: Callable[[], dict[str, Any]] = dict) -> Optional[dict[str, Any]]:
        """Count a finished step; on a logging step, reduce and (rank 0) write the record, which is returned.
        ``fields()`` gives ``lr`` and ``grad_scale`` where known (called only when a record is written)."""
        self.window_steps += 1
        self.window_samples += samples
        if not self.due(step):
            return None
        now = time.perf_counter()
        window_s, window_steps, window_samples = now - self.window_start, self.window_steps, self.window_samples
        self.window_start, self.window_steps, self.window_samples = now, 0, 0
        return self._write(step, loss, dict(extra or {}), window_s, window_steps, window_samples, step_time_s, fields)

    def _write(self, step: int, loss: Any, extra: dict[str, Any], window_s: float, window_steps: int,
               window_samples: int, step_time_s: float, fields: Callable[[], dict[str, Any]]) -> Optional[dict]:
        clash = sorted(set(extra) & set(RECORD_KEYS))
        if clash:
            raise ValueError(f"metrics {clash} clash with the record's own keys ({', '.join(RECORD_KEYS)}). "
                             "Fix: rename them")
        # Loss, extra metrics and the step-time breakdown ride in one all-reduce: the record holds means over ranks.
        timing = self.timer.window(window_steps)
        values = [_scalar(loss, self.device)] if loss is not None else []
        values += [_scalar(v, self.device) for v in extra.values()]
        values.append(torch.tensor(list(timing.values()), dtype=torch.float32, device=self.device))
        means = self.across(collectives.all_reduce(torch.cat(values)) / self.ctx.world_size).tolist()
        if loss is not None:
            self.last_loss, means = means[0], means[1:]
        extra = dict(zip(extra, means))
        timing = dict(zip(timing, means[len(extra):]))
        if not self.ctx.is_main:
            return None
        record = {"t": time.time(), "step": step, "loss": self.last_loss if loss is not None else None,
                  "lr": None, "world_size": self.ctx.job_world_size,
                  # samples the script never reported (step_done without samples=) are no throughput of 0
                  "samples_per_s": window_samples / window_s if window_samples and window_s > 0 else None,
                  "step_time_s": window_s / window_steps, "last_step_time_s": step_time_s,
                  "restart_count": self.ctx.restart_count}
        known = fields()
        record["lr"] = known.get("lr")
        if timing:
            record["timing"] = with_other(timing, record["step_time_s"])
        if known.get("grad_scale") is not None:
            record["grad_scale"] = known["grad_scale"]
        if known.get("ft") is not None:  # the fault-tolerance mode's seconds within the window (quorums, healing)
            record["ft"] = known["ft"]
        record.update(extra)
        if self.path is not None:
            append_jsonl(self.path, record)
        if self.trackers is not None:
            self.trackers.log_metrics(step, flatten(record))
        print(progress_line(record, self.ctx.rank, self.max_steps), flush=True)
        return record


def _scalar(value: Any, device: torch.device) -> torch.Tensor:
    """One float32 element on ``device`` (a tensor is detached, not copied to the host: no sync here)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(1).float().to(device)
    return torch.tensor([float(value)], dtype=torch.float32, device=device)


def flatten(record: dict[str, Any]) -> dict[str, Any]:
    """The record as trackers take it (``train/loss``, ``system/world_size``, ``system/timing/<phase>_s``: see
    orchestrator/tracking/names.py)."""
    from orchestrator.tracking.names import train_metrics

    return train_metrics(record)


def progress_line(record: dict[str, Any], rank: int, max_steps: int) -> str:
    loss = f" loss {record['loss']:.4f}" if record["loss"] is not None else ""
    lr = f" lr {record['lr']:.2e}" if record["lr"] is not None else ""
    rate = f" {record['samples_per_s']:.1f} samples/s" if record.get("samples_per_s") is not None else ""
    return f"[rank{rank}] step {record['step']}/{max_steps}{loss}{lr}{rate} world {record['world_size']}"
