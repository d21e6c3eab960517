"""The built-in training loop: DDP, AMP, gradient accumulation, LR schedule, metrics, checkpoints."""

from __future__ import annotations

import contextlib
import inspect
import hashlib
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from orchestrator.config.schema import OrchConfig
from orchestrator.rundir import EventLog, EventName, METRICS_FILE, append_jsonl
from orchestrator.runtime.checkpointing import TrainingCheckpoints
from orchestrator.runtime.distributed import DistContext, select_device
from orchestrator.runtime.precision import MixedPrecision
from orchestrator.runtime.preemption import PreemptionResponse
from orchestrator.runtime.sampler import GlobalBatchSampler
from orchestrator.runtime.timing import StartupTimes, StepTimer, latest_over_ranks, timer_for, with_other


DDP_PARAMS = inspect.signature(DDP.__init__).parameters


@dataclass
class Progress:
    """Where training stands; what a checkpoint must restore besides the tensors."""

    step: int = 0
    samples_consumed: int = 0
    epoch: int = 0


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over parameter names and raw bytes in module order: equal only for bit-identical models."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Trains ``cfg.model`` on ``cfg.data`` for ``cfg.trainer.max_steps`` optimizer steps in the current
    process group. Rank 0 writes metrics.jsonl and the run's training events into ``run_dir``.

    ``startup``: the worker's start-up times so far (the entry point's); the trainer adds its own milestones
    and rank 0 reports them all as ``worker_started`` before the first step."""

    def __init__(self, cfg: OrchConfig, ctx: DistContext, run_dir: str, events: EventLog,
                 timer: Optional[StepTimer] = None, startup: Optional[StartupTimes] = None):
        self.cfg, self.ctx, self.run_dir, self.events = cfg, ctx, run_dir, events
        self.startup = startup or StartupTimes()
        self.device = select_device(cfg.cluster.device, ctx.local_rank)
        self.timer = timer or timer_for(self.device)  # per-step time breakdown (runtime/timing.py)
        seed_everything(cfg.trainer.seed)  # identical init on every rank, before DDP's broadcast makes sure
        self.raw_model = instantiate(cfg.model, _convert_="all").to(self.device)
        self.model = self._wrap(self.raw_model)
        self.optimizer = instantiate(cfg.optim, params=self.raw_model.parameters(), _convert_="all")
        self.scheduler = instantiate(cfg.scheduler, optimizer=self.optimizer, _convert_="all")
        self.precision = MixedPrecision(cfg.amp.enabled, cfg.amp.dtype, self.device)
        self.dataset = instantiate(cfg.data.dataset, _convert_="all")
        self.progress = Progress()
        self.checkpoints = TrainingCheckpoints(self, cfg.checkpoint.url or f"{run_dir}/checkpoints")
        self.preemption = PreemptionResponse(self)
        self.last_loss: Optional[float] = None
        self.startup.mark("model")

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.cfg.trainer.compile:
            model = torch.compile(model, mode=self.cfg.trainer.compile_mode)
        d = self.cfg.ddp
        # Newer torch renamed broadcast_buffers (per-forward buffer sync) to forward_sync_buffers.
        buffers_flag = "forward_sync_buffers" if "forward_sync_buffers" in DDP_PARAMS else "broadcast_buffers"
        ddp = DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            static_graph=d.static_graph,
            find_unused_parameters=d.find_unused_parameters,
            gradient_as_bucket_view=d.gradient_as_bucket_view,
            bucket_cap_mb=d.bucket_cap_mb,
            **{buffers_flag: d.broadcast_buffers},
        )
        self.timer.register(ddp)
        return ddp

    def _loader(self) -> tuple[GlobalBatchSampler, DataLoader]:
        t, d = self.cfg.trainer, self.cfg.data
        sampler = GlobalBatchSampler(len(self.dataset), t.global_batch_size, t.micro_batch_size, self.ctx.world_size,
                                     self.ctx.rank, seed=t.seed, start_sample=self.progress.samples_consumed,
                                     drop_last=d.drop_last)
        extra = {"prefetch_factor": d.prefetch_factor} if d.num_workers and d.prefetch_factor else {}
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=d.num_workers,
                            pin_memory=d.pin_memory and self.device.type == "cuda",
                            persistent_workers=d.persistent_workers, **extra)
        return sampler, loader

    def fit(self) -> dict[str, Any]:
        """Train to max_steps; returns what rank 0 reports as the training result."""
        t = self.cfg.trainer
        self.checkpoints.restore()
        self.startup.mark("restore")
        sampler, loader = self._loader()
        batches = iter(loader)
        print(f"[rank{self.ctx.rank}] world size {self.ctx.world_size}, {sampler.accumulation_steps} accumulation "
              f"step(s), device {self.device}, starting at step {self.progress.step}", flush=True)
        self.startup.mark("ready")
        self._report_startup()
        anomaly = torch.autograd.set_detect_anomaly(True) if t.detect_anomaly else contextlib.nullcontext()
        window_start, window_steps = time.perf_counter(), 0
        first_step = self.progress.step + 1
        with anomaly:
            while self.progress.step < t.max_steps:
                step_start = time.perf_counter()
                self.timer.mark()
                loss, sample_ids = self.train_step(batches, sampler.accumulation_steps)
                self.progress.step += 1
                self.progress.samples_consumed += t.global_batch_size
                self.progress.epoch = sampler.epoch_of(self.progress.samples_consumed)
                window_steps += 1
                self._record_samples(sample_ids)
                if self.progress.step == first_step and self.ctx.is_main:  # what recovery times (MTTR) end on
                    self.events.emit(EventName.FIRST_STEP, step=first_step, world_size=self.ctx.world_size,
                                     restart_count=self.ctx.restart_count)
                if self.progress.step % t.log_every == 0 or self.progress.step == t.max_steps:
                    now = time.perf_counter()
                    self._log_metrics(loss, now - window_start, window_steps, now - step_start)
                    window_start, window_steps = now, 0
                self.after_step()
        return self.finish()

    def _report_startup(self) -> None:
        """Rank 0 writes ``worker_started``: each start-up milestone's latest time over all ranks (goodput splits
        a recovery by them). One small all_gather per attempt; the first step would wait for the slowest rank
        anyway."""
        per_rank: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(per_rank, self.startup.fields())
        if self.ctx.is_main:
            self.events.emit(EventName.WORKER_STARTED, world_size=self.ctx.world_size, restart_count=self.ctx.restart_count,
                             step=self.progress.step, **latest_over_ranks(per_rank))

    def train_step(self, batches, accumulation_steps: int) -> tuple[torch.Tensor, list[int]]:
        """One optimizer step over ``accumulation_steps`` micro-batches; DDP all-reduces only on the last."""
        total = torch.zeros((), device=self.device)
        sample_ids: list[int] = []
        for micro in range(accumulation_steps):
            batch = next(batches)
            sample_ids += batch["sample_id"].tolist()
            self.timer.lap("data")
            sync = micro == accumulation_steps - 1
            with (contextlib.nullcontext() if sync else self.model.no_sync()), self.precision.autocast():
                loss = self.model(batch["input_ids"].to(self.device, non_blocking=True),
                                  batch["labels"].to(self.device, non_blocking=True)) / accumulation_steps
            self.precision.scaler.scale(loss).backward()
            total += loss.detach()
            self.timer.lap_backward()
        scaler = self.precision.scaler
        if self.cfg.trainer.grad_clip_norm is not None:
            scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.trainer.grad_clip_norm)
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.timer.lap("optimizer")
        return total, sample_ids

    def after_step(self) -> None:
        """Work at every step boundary: a coordinated emergency checkpoint on notice, else periodic ones."""
        self.preemption.check()  # raises PreemptedExit after the emergency checkpoint
        self.timer.mark()
        self.checkpoints.maybe_save()
        self.timer.lap("checkpoint")

    def _log_metrics(self, loss: torch.Tensor, window_s: float, window_steps: int, step_time_s: float) -> None:
        # The all-reduce runs only on logging steps, which every rank agrees on, to keep the loop lean.
        # The step-time breakdown rides along in the same all-reduce: the record holds its mean over ranks.
        timing = self.timer.window(window_steps)
        packed = torch.cat([loss.reshape(1).float(), torch.tensor(list(timing.values()), device=loss.device)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        totals = packed.tolist()
        self.last_loss = totals[0] / self.ctx.world_size
        timing = {k: v / self.ctx.world_size for k, v in zip(timing, totals[1:])}
        if not self.ctx.is_main:
            return
        record = {
            "t": time.time(), "step": self.progress.step, "loss": self.last_loss,
            "lr": self.scheduler.get_last_lr()[0], "world_size": self.ctx.world_size,
            "samples_per_s": self.cfg.trainer.global_batch_size * window_steps / window_s,
            "step_time_s": window_s / window_steps, "last_step_time_s": step_time_s,
            "restart_count": self.ctx.restart_count,
        }
        if timing:
            record["timing"] = with_other(timing, record["step_time_s"])
        if self.precision.scaler.is_enabled():
            record["grad_scale"] = self.precision.scaler.get_scale()
        append_jsonl(Path(self.run_dir) / METRICS_FILE, record)
        print(f"[rank{self.ctx.rank}] step {record['step']}/{self.cfg.trainer.max_steps} loss {record['loss']:.4f} "
              f"lr {record['lr']:.2e} {record['samples_per_s']:.1f} samples/s world {self.ctx.world_size}", flush=True)

    def _record_samples(self, sample_ids: list[int]) -> None:
        """With trainer.record_sample_ids, each rank logs which samples each step trained on (for audits)."""
        if self.cfg.trainer.record_sample_ids:
            path = Path(self.run_dir) / "samples" / f"rank{self.ctx.rank}.jsonl"
            path.parent.mkdir(exist_ok=True)
            append_jsonl(path, {"step": self.progress.step, "ids": sample_ids, "world_size": self.ctx.world_size,
                                "restart_count": self.ctx.restart_count})

    def finish(self) -> dict[str, Any]:
        self.preemption.stop()
        self.checkpoints.finish()
        result = {"steps_completed": self.progress.step, "final_loss": self.last_loss,
                  "params_sha256": params_sha256(self.raw_model), "world_size": self.ctx.world_size,
                  "progress": asdict(self.progress)}
        if self.ctx.is_main:
            self.events.emit(EventName.TRAINING_FINISHED, **result)
        return result
