"""The built-in training loop: a parallelism strategy (DDP, FSDP2, HSDP), AMP, gradient accumulation, LR
schedule, on an elastic session.

The session (orchestrator/elastic/) does the work at every step boundary, as it does for a user's script:
metrics, the preemption agreement, periodic/emergency/final checkpoints, the restore at start. The trainer
brings the model, optimizer, schedule and data from the run's config, and the step itself; how the model is
spread over the ranks is the strategy's (orchestrator/parallel/), which the trainer never asks about.
"""

from __future__ import annotations

import time

import contextlib
import random
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from orchestrator.config.schema import OrchConfig
from orchestrator.elastic import GlobalBatchSampler, Session
from orchestrator.parallel.base import handoff_kwargs
from orchestrator.rundir import SAMPLES_DIR, append_jsonl
from orchestrator.runtime.precision import MixedPrecision


# Settings that change the math but not the shapes: a mismatch on resume warns (the shapes check refuses).
FINGERPRINT_KEYS = ("model", "optim", "scheduler", "data.dataset", "trainer.global_batch_size", "trainer.seed",
                    "trainer.grad_clip_norm", "amp")


def math_settings(cfg: OrchConfig) -> dict[str, Any]:
    """The values of FINGERPRINT_KEYS, for :meth:`Session.fingerprint`."""
    def value(key: str) -> Any:
        obj: Any = cfg
        for part in key.split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
        return obj

    return {k: value(k) for k in FINGERPRINT_KEYS}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Trains ``cfg.model`` on ``cfg.data`` for ``cfg.trainer.max_steps`` optimizer steps in ``session`` (whose
    config is the run's, and whose ``timer`` is a StepTimer: ``elastic.init(step_timer=True)``). Rank 0 writes
    metrics.jsonl and the run's training events into the session's run dir."""

    def __init__(self, session: Session):
        if session.cfg is None:
            raise ValueError("the built-in trainer needs the run's config. Fix: elastic.init(config=<run dir>/config.yaml)")
        self.session, self.cfg, self.ctx = session, session.cfg, session.ctx
        cfg = self.cfg
        self.device = session.device
        self.timer = session.timer  # the time breakdown of every step (runtime/timing.py)
        seed_everything(cfg.trainer.seed)  # identical init on every rank (the strategy's broadcast makes sure)
        self.strategy = session.strategy
        # The strategy builds it: a sharded one never builds the whole model on every rank.
        # per_step: the strategy hands each gradient to the mode as soon as it is final within this node's
        # group, so its average over the other groups overlaps the backward pass.
        self.model = self.strategy.build(lambda: instantiate(cfg.model, _convert_="all"), self.ctx, self.device,
                                         timer=self.timer, **handoff_kwargs(session.ft.gradient_handoff()))
        self.raw_model = self.strategy.unwrap(self.model)  # what checkpoints hold
        # After wrapping: a sharded strategy's parameters are DTensors, and the optimizer must hold those.
        self.optimizer = instantiate(cfg.optim, params=self.model.parameters(), _convert_="all")
        self.scheduler = instantiate(cfg.scheduler, optimizer=self.optimizer, _convert_="all")
        scaler = self.strategy.grad_scaler(cfg.amp.enabled and cfg.amp.dtype == "fp16", self.device)
        self.precision = MixedPrecision(cfg.amp.enabled, cfg.amp.dtype, self.device, scaler=scaler)
        self.dataset = instantiate(cfg.data.dataset, _convert_="all")
        session.fingerprint(math_settings(cfg))
        session.register(model=self.raw_model, optim=self.optimizer, scheduler=self.scheduler,
                         scaler=self.precision.scaler)

    def _loader(self) -> tuple[GlobalBatchSampler, DataLoader]:
        t, d = self.cfg.trainer, self.cfg.data
        sampler = self.session.global_batch_sampler(len(self.dataset), t.global_batch_size, t.micro_batch_size,
                                                    seed=t.seed, drop_last=d.drop_last)
        extra = {"prefetch_factor": d.prefetch_factor} if d.num_workers and d.prefetch_factor else {}
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=d.num_workers,
                            pin_memory=d.pin_memory and self.device.type == "cuda",
                            persistent_workers=d.persistent_workers, **extra)
        return sampler, loader

    def fit(self) -> dict[str, Any]:
        """Train to max_steps; returns what rank 0 reports as the training result."""
        t, session = self.cfg.trainer, self.session
        session.restore()
        sampler, loader = self._loader()
        batches = iter(loader)
        print(f"[rank{self.ctx.rank}] world size {self.ctx.world_size}, {sampler.accumulation_steps} accumulation "
              f"step(s), device {self.device}, starting at step {session.step}", flush=True)
        anomaly = torch.autograd.set_detect_anomaly(True) if t.detect_anomaly else contextlib.nullcontext()
        with anomaly:
            for step in session.steps():
                loss, sample_ids = self.train_step(batches, sampler.accumulation_steps)
                # Only a step that counts is part of the lineage (decided by now: the optimizer has stepped).
                if session.ft.commit():
                    where = session.ft.sample_record(self.ctx, session.samples_consumed, sampler.W, sampler.r)
                    self._record_samples(step, sample_ids, where)
                session.step_done(loss=loss, samples=t.global_batch_size)
        return session.finish()

    def train_step(self, batches, accumulation_steps: int) -> tuple[torch.Tensor, list[int]]:
        """One optimizer step over ``accumulation_steps`` micro-batches; gradients sync only on the last."""
        total = torch.zeros((), device=self.device)
        sample_ids: list[int] = []
        for micro in range(accumulation_steps):
            batch = next(batches)
            sample_ids += batch["sample_id"].tolist()
            self.timer.lap("data")
            sync = micro == accumulation_steps - 1
            with (contextlib.nullcontext() if sync else self.strategy.no_sync(self.model)), self.precision.autocast():
                loss = self.model(batch["input_ids"].to(self.device, non_blocking=True),
                                  batch["labels"].to(self.device, non_blocking=True)) / accumulation_steps
            self.precision.scaler.scale(loss).backward()
            total += loss.detach()
            self.timer.lap_backward()
        scaler = self.precision.scaler
        if self.cfg.trainer.grad_clip_norm is not None:
            scaler.unscale_(self.optimizer)
            self.strategy.clip_grad_norm_(self.model, self.cfg.trainer.grad_clip_norm)
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.timer.lap("optimizer")
        return total, sample_ids

    def _record_samples(self, step: int, sample_ids: list[int], where: tuple[str, dict[str, Any]]) -> None:
        """With trainer.record_sample_ids, each rank logs which samples each step trained on (for audits), in
        the file and with the fields the fault-tolerance mode names (``where``: ``samples/rank<R>.jsonl`` in
        restart mode; see :meth:`~orchestrator.ft.steps.StepProtocol.sample_record`)."""
        if self.cfg.trainer.record_sample_ids and self.session.run_dir is not None:
            name, fields = where
            path = Path(self.session.run_dir) / SAMPLES_DIR / f"{name}.jsonl"
            path.parent.mkdir(exist_ok=True)
            append_jsonl(path, {"step": step, "ids": sample_ids, "world_size": self.ctx.world_size,
                                "restart_count": self.ctx.restart_count, "t": time.time(), **fields})
