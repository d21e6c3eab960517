"""What a training checkpoint holds, and how a (possibly resized) job restores it.

Rank 0 writes; every rank reads. Model, optimizer, scheduler and GradScaler states are identical on every
rank under DDP, so rank 0's copy is the job's. RNG states differ per rank: they are gathered to rank 0 at
the save. On restore at another world size, ranks that existed before get their own RNG state back and
new ranks are seeded from (seed, rank, step); the data position is a global sample index, so the sampler
continues exactly where the job stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from orchestrator.checkpoint import CheckpointError, CheckpointManager
from orchestrator.config.schema import OrchConfig
from orchestrator.rundir import EventName

if TYPE_CHECKING:
    from orchestrator.runtime.trainer import Trainer

# Settings that change the math but not the shapes: a mismatch on resume warns (the shapes check refuses).
FINGERPRINT_KEYS = ("model", "optim", "scheduler", "data.dataset", "trainer.global_batch_size", "trainer.seed",
                    "trainer.grad_clip_norm", "amp")


def config_fingerprint(cfg: OrchConfig) -> dict[str, str]:
    """A short hash per math-relevant setting, so a mismatch can be named key by key."""
    def value(key: str) -> Any:
        obj: Any = cfg
        for part in key.split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
        return asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj

    return {k: hashlib.sha256(json.dumps(value(k), sort_keys=True, default=str).encode()).hexdigest()[:12]
            for k in FINGERPRINT_KEYS}


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_model_fits(checkpoint_model: dict[str, torch.Tensor], model: torch.nn.Module, step: int) -> None:
    """Refuse a checkpoint whose parameter names or shapes differ, listing every differing key
    (instead of ``strict=False`` silently leaving layers at their random init)."""
    current = model.state_dict()
    missing = sorted(set(current) - set(checkpoint_model))
    unexpected = sorted(set(checkpoint_model) - set(current))
    reshaped = sorted(f"{k} {tuple(checkpoint_model[k].shape)}->{tuple(current[k].shape)}"
                      for k in set(current) & set(checkpoint_model) if checkpoint_model[k].shape != current[k].shape)
    if missing or unexpected or reshaped:
        parts = [f"{name} ({len(keys)}): {', '.join(keys[:20])}{' ...' if len(keys) > 20 else ''}"
                 for name, keys in (("missing", missing), ("unexpected", unexpected), ("shape changed", reshaped))
                 if keys]
        raise CheckpointError(f"checkpoint step {step} does not fit the model ({'; '.join(parts)}). Fix: resume with "
                              "the model it was saved from, or start fresh with checkpoint.resume=never or a new "
                              "checkpoint.url")


class TrainingCheckpoints:
    """Periodic, final and restoring checkpoint logic of one Trainer."""

    def __init__(self, trainer: "Trainer", url: str):
        self.trainer = trainer
        self.cfg = trainer.cfg.checkpoint
        emit = trainer.events.emit if trainer.ctx.is_main else (lambda *a, **k: None)
        self.manager = CheckpointManager(url, keep_last=self.cfg.keep_last, async_save=self.cfg.async_save,
                                         on_event=lambda name, fields: self._on_event(emit, name, fields))
        self.last_saved_step: Optional[int] = None
        self.last_save_s: Optional[float] = None  # stall + write of the latest committed save (rank 0)

    def _on_event(self, emit, name: str, fields: dict) -> None:
        if name == EventName.CHECKPOINT_SAVED:
            self.last_save_s = fields.get("stall_s", 0.0) + fields.get("write_s", 0.0)
        emit(name, **fields)

    def expected_save_s(self) -> Optional[float]:
        """How long a synchronous save should take, judged from the last one (None before any)."""
        return self.last_save_s

    # -- save ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "model": t.raw_model.state_dict(),
            "optim": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "scaler": t.precision.scaler.state_dict(),
            "trainer": {**asdict(t.progress), "world_size": t.ctx.world_size},
        }

    def save(self, reason: str = "periodic") -> float:
        """Checkpoint the current step (all ranks call this: RNG states are gathered). Returns the stall."""
        t = self.trainer
        rngs: list[Any] = [None] * t.ctx.world_size
        dist.all_gather_object(rngs, rng_state(t.device))
        stall_s = 0.0
        if t.ctx.is_main:
            per_key = config_fingerprint(t.cfg)
            combined = hashlib.sha256(json.dumps(per_key, sort_keys=True).encode()).hexdigest()[:16]
            metadata = {"config_fingerprint": combined, "config_fingerprint_keys": per_key,
                        "world_size": t.ctx.world_size,
                        "reason": reason, **asdict(t.progress)}
            stall_s = self.manager.save(t.progress.step, {**self.state(), "rng": {"per_rank": rngs}}, metadata)
        self.last_saved_step = t.progress.step
        return stall_s

    def maybe_save(self) -> None:
        n = self.cfg.every_n_steps
        if n and self.trainer.progress.step % n == 0:
            self.save()

    def finish(self) -> None:
        """The final checkpoint (unless this step was just saved), then wait for any write in flight."""
        if self.last_saved_step != self.trainer.progress.step:
            self.save(reason="final")
        if self.trainer.ctx.is_main:
            self.manager.wait()

    # -- restore ------------------------------------------------------------------------------------
    def restore(self) -> Optional[int]:
        """Load per ``checkpoint.resume`` (auto | never | step); returns the step restored, if any.

        Rank 0 picks the checkpoint and broadcasts the step, so every rank loads the same one even while
        newer directories appear or are found corrupt.
        """
        t = self.trainer
        if self.cfg.resume == "never":
            return None
        started = time.perf_counter()
        choice: list[Any] = [None]
        if t.ctx.is_main:
            wanted = None if self.cfg.resume == "auto" else int(self.cfg.resume)
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                loaded = self.manager.load(wanted)
            choice = [loaded.step if loaded else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        loaded = loaded if t.ctx.is_main else self.manager.load(choice[0])
        self._apply(loaded.state, loaded.metadata, loaded.step)
        if t.ctx.is_main:
            t.events.emit(EventName.CHECKPOINT_LOADED, step=loaded.step, world_size=t.ctx.world_size,
                          saved_world_size=loaded.metadata.get("world_size"), restore_s=time.perf_counter() - started)
        return loaded.step

    def _apply(self, state: dict[str, Any], metadata: dict[str, Any], step: int) -> None:
        t = self.trainer
        check_model_fits(state["model"], t.raw_model, step)
        changed = [k for k, v in config_fingerprint(t.cfg).items() if metadata.get("config_fingerprint_keys", {}).get(k) != v]
        if changed and t.ctx.is_main:
            warnings.warn(f"resuming step {step} with changed settings: {', '.join(changed)}", RuntimeWarning)
            t.events.emit(EventName.CHECKPOINT_CONFIG_CHANGED, step=step, keys=changed)
        t.raw_model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optim"])
        t.scheduler.load_state_dict(state["scheduler"])
        t.precision.scaler.load_state_dict(state["scaler"])
        progress = state["trainer"]
        t.progress.step, t.progress.samples_consumed = progress["step"], progress["samples_consumed"]
        t.progress.epoch = progress["epoch"]
        per_rank = state["rng"]["per_rank"]
        if t.ctx.rank < len(per_rank):
            set_rng_state(per_rank[t.ctx.rank], t.device)
        else:  # a rank the checkpointed job did not have: seeded, reproducibly, from where it joins
            random.seed(t.cfg.trainer.seed * 1_000_003 + t.ctx.rank * 7919 + step)
            torch.manual_seed(t.cfg.trainer.seed * 1_000_003 + t.ctx.rank * 7919 + step)
        self.last_saved_step = step
