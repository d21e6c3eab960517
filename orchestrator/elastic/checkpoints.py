"""A session's checkpoints: periodic, final and emergency saves, and the restore at start, through orch's
:class:`~orchestrator.checkpoint.CheckpointManager` (fsspec, atomic by manifest-last, async writes).

Who writes is the engine ``checkpoint.engine`` names (orchestrator/checkpoint/engines.py): ``rank0`` (rank 0
writes the whole state, every rank reads) or ``dcp`` (every rank writes its shards). Every rank calls
:meth:`SessionCheckpoints.save` (the RNG states are gathered) and :meth:`SessionCheckpoints.restore` (rank 0
picks the checkpoint and the engine hands its step to every rank, so every rank loads the same one even while
newer directories appear or are found corrupt).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import asdict, is_dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from orchestrator.checkpoint import CheckpointManager
from orchestrator.checkpoint.engines import make_engine
from orchestrator.checkpoint.fence import fence_from_env
from orchestrator.checkpoint.interval import PROBE_STEPS, IntervalPolicy
from orchestrator.config.schema import CheckpointConfig
from orchestrator.elastic import collectives
from orchestrator.events import (CheckpointConfigChanged, CheckpointInterval, CheckpointLoaded, CheckpointSaved, Event,
                                 LeaseLost, event_of)
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import RNG_PAYLOAD, RankRngStates, TrainingState, rng_state

WriteEvent = Callable[[Event], None]
"""``write(event)``: records one of orchestrator/events.py's events (or drops it: not this rank's, no run dir)."""


def hash_settings(settings: Mapping[str, Any]) -> dict[str, str]:
    """A short hash per setting, so a mismatch on resume can be named key by key."""
    def canonical(value: Any) -> str:
        value = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
        return json.dumps(value, sort_keys=True, default=str)

    return {k: hashlib.sha256(canonical(v).encode()).hexdigest()[:12] for k, v in settings.items()}


class SessionCheckpoints:
    """Saves and restores ``state`` at ``url`` per ``cfg`` (``every_n_steps``, ``keep_last``, ``async_save``,
    ``resume``; its ``url`` is ignored: ``url`` is the resolved one; ``engine``: the resolved
    ``checkpoint.engine``, :func:`orchestrator.config.schema.checkpoint_engine`). ``write(event)`` records events
    (rank 0's; others pass a no-op). ``fingerprint``: a short hash per setting that changes the math: stored
    in each checkpoint (:func:`hash_settings`); a resume whose fingerprint differs warns and emits
    ``checkpoint_config_changed``.
    ``seed`` seeds the RNGs of ranks the checkpointed job did not have. ``run_dir``: the run's history, which
    ``every_n_steps=auto`` reads (interruptions so far, save stalls). Under orch's launcher every save to the
    URL it leased (``cfg.url``, else ``<run_dir>/checkpoints``) is fenced: committed only while that lease is
    this run's (orchestrator/checkpoint/fence.py); the first time another run holds it, ``lease_lost`` is
    emitted and the launcher stops the run."""

    def __init__(self, cfg: CheckpointConfig, url: str, state: TrainingState, ctx: DistContext,
                 device: torch.device, seed: int, write: WriteEvent, fingerprint: Optional[dict[str, str]] = None,
                 run_dir: Optional[str] = None, engine: str = "rank0"):
        self.cfg, self.url, self.state, self.ctx, self.device, self.seed = cfg, url, state, ctx, device, seed
        self.write, self.fingerprint = write, fingerprint
        # The launcher's run id (ORCH_RUN_ID) goes into every manifest: retention keeps to this run's own steps.
        leased = cfg.url or (f"{run_dir}/checkpoints" if run_dir is not None else None)
        self.fence = fence_from_env(url, leased)
        self.manager = CheckpointManager(url, keep_last=cfg.keep_last, async_save=cfg.async_save,
                                         on_event=self._on_event, run_id=os.environ.get("ORCH_RUN_ID"),
                                         format=cfg.format, fence=self._fence_check if self.fence else None)
        self.engine = make_engine(engine, self.manager, state, ctx, collectives, cfg.async_save)
        self.last_saved_step: Optional[int] = None
        self.last_save_s: Optional[float] = None  # stall + write of the latest committed save (rank 0)
        # every_n_steps=auto: rank 0 measures and decides; every rank keeps the same next decision step.
        self.auto = cfg.every_n_steps == "auto"
        self.policy = (IntervalPolicy(cfg.auto_prior_mtbf_s, cfg.auto_prior_weight, run_dir)
                       if self.auto and ctx.is_main else None)
        self.interval: Optional[int] = None
        self._decide_at: Optional[int] = None
        self._tick: Optional[float] = None

    def _on_event(self, name: str, fields: dict) -> None:
        """The manager's events (handed over as a name and fields), written as the typed events they are."""
        event = event_of(name, fields)
        if isinstance(event, CheckpointSaved):
            self.last_save_s = event.stall_s + event.write_s
        self.write(event)

    def _fence_check(self) -> Optional[str]:
        """The manager's fence: why this save may not commit, or None; ``lease_lost`` once another run holds it."""
        was_lost = self.fence.lost is not None
        verdict = self.fence.refusal()
        if verdict is None:
            return None
        if verdict.lost_to is not None and not was_lost:
            self.write(LeaseLost(url=self.url, setting="checkpoint.url", holder=verdict.lost_to, by="worker",
                                step=self.state.progress.step,
                                reason=f"lease on checkpoint.url={self.url} lost to run {verdict.lost_to}"))
        return verdict.reason

    def expected_save_s(self) -> Optional[float]:
        """How long a synchronous save should take, judged from the last one (None before any)."""
        return self.last_save_s

    # -- save ---------------------------------------------------------------------------------------
    def save(self, reason: str = "periodic", sync: bool = False) -> float:
        """Checkpoint the current step (every rank calls this); ``sync``: committed before it returns (an
        emergency save). Returns the seconds the loop was blocked."""
        progress = self.state.progress
        rngs = collectives.all_gather_object(rng_state(self.device), self.ctx.world_size)
        metadata: Optional[dict[str, Any]] = None
        if self.ctx.is_main:
            metadata = {}
            if self.fingerprint is not None:
                combined = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
                metadata = {"config_fingerprint": combined, "config_fingerprint_keys": self.fingerprint}
            metadata.update({"world_size": self.ctx.world_size, "reason": reason, "step": progress.step,
                             "samples_consumed": progress.samples_consumed, "epoch": progress.epoch})
        rng = RankRngStates(self.device, per_rank=rngs)
        stall_s = self.engine.save(progress.step, metadata, {RNG_PAYLOAD: rng}, sync=sync)
        self.last_saved_step = progress.step
        return stall_s

    def wait(self) -> None:
        """Every rank: until this rank's save in flight is committed; CheckpointError if it failed."""
        self.engine.wait()

    def maybe_save(self) -> None:
        """The periodic save, every ``every_n_steps`` steps (0: none; ``auto``: :meth:`_auto_save`)."""
        n = self.cfg.every_n_steps
        if self.auto:
            self._auto_save()
        elif n and self.state.progress.step % n == 0:
            self.save()

    def _auto_save(self) -> None:
        """``every_n_steps=auto``. Decisions fall on steps every rank knows (the attempt's step ``PROBE_STEPS``,
        then each save), where rank 0 broadcasts whether to save and then the next interval, so the ranks never
        disagree on a collective save and cost no collective on the steps between."""
        step, now = self.state.progress.step, time.perf_counter()
        if self.policy is not None and self._tick is not None:
            self.policy.observe_step(now - self._tick)
        self._tick = now
        if self._decide_at is None:
            self._decide_at = step + PROBE_STEPS - 1
        if step < self._decide_at:
            return
        due = None
        if self.policy is not None:
            interval = self.policy.decide(self.interval)  # None until a save's stall was measured: save to measure it
            due = interval is None or step - (self.last_saved_step or 0) >= interval
        due = collectives.broadcast_object(due)
        if due:
            stall_s = self.save()
            if self.policy is not None:
                self.policy.observe_save(stall_s)
        decided = self.policy.decide(self.interval) if self.policy is not None else None
        interval = collectives.broadcast_object(decided) or PROBE_STEPS
        if self.policy is not None and interval != self.interval:
            self.write(CheckpointInterval(step=step, every_n_steps=interval, previous=self.interval,
                                         **self.policy.fields()))
        self.interval = interval
        self._decide_at = max(step + 1, (self.last_saved_step or 0) + interval)
        self._tick = time.perf_counter()  # the save's stall is not a step

    def finish(self) -> None:
        """The final checkpoint (unless this step was just saved), then wait for any write in flight."""
        if self.last_saved_step != self.state.progress.step:
            self.save(reason="final")
        self.engine.wait()

    # -- restore ------------------------------------------------------------------------------------
    def restore(self) -> Optional[int]:
        """Load per ``resume`` (auto | never | step); returns the step restored, or None."""
        if self.cfg.resume == "never":
            return None
        started = time.perf_counter()
        wanted = None if self.cfg.resume == "auto" else int(self.cfg.resume)
        rng = RankRngStates(self.device, self.ctx.rank, self.seed, self.state.progress)
        loaded = self.engine.restore(wanted, {RNG_PAYLOAD: rng})
        if loaded is None:
            return None
        step = loaded.step
        self._warn_changed(loaded.metadata, step)
        self.last_saved_step = step
        self.write(CheckpointLoaded(step=step, world_size=self.ctx.world_size,
                                   saved_world_size=loaded.metadata.get("world_size"),
                                   restore_s=time.perf_counter() - started))
        return step

    def _warn_changed(self, metadata: dict[str, Any], step: int) -> None:
        if self.fingerprint is None:
            return
        saved = metadata.get("config_fingerprint_keys", {})
        changed = [k for k, v in self.fingerprint.items() if saved.get(k) != v]
        if changed and self.ctx.is_main:
            warnings.warn(f"resuming step {step} with changed settings: {', '.join(changed)}", RuntimeWarning)
            self.write(CheckpointConfigChanged(step=step, keys=changed))
