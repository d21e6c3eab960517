"""The :class:`Session`: what a training script holds while it runs under orch (or without it).

It owns the run's settings, the registered training state, and the work at every step boundary: metrics,
the preemption agreement, periodic and emergency checkpoints. The usual way in is
:func:`orchestrator.elastic.init`, which also finds the run's config and joins the process group.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any, Iterator, Mapping, Optional

import torch

from orchestrator.config.schema import CheckpointConfig, OrchConfig, PreemptionConfig, TrainerConfig, checkpoint_engine
from orchestrator.elastic import collectives
from orchestrator.elastic.checkpoints import SessionCheckpoints, hash_settings
from orchestrator.elastic.heartbeat import Heartbeat
from orchestrator.elastic.metrics import MetricsLog
from orchestrator.elastic.preemption import PreemptedExit, PreemptionResponse
from orchestrator.elastic.worker_events import (WorkerEvents, first_step, training_finished, worker_failed,
                                                worker_started)
from orchestrator.ft.steps import StepProtocol
from orchestrator.ft.worker import step_protocol
from orchestrator.parallel import Strategy, strategy_for
from orchestrator.parallel.base import handoff_kwargs
from orchestrator.runtime.distributed import DistContext, select_device
from orchestrator.runtime.sampler import GlobalBatchSampler
from orchestrator.runtime.state import Progress, Record, TrainingState
from orchestrator.runtime.timing import NullStepTimer, StartupTimes, timer_for


class Session:
    """One worker's view of a training run. Every rank creates one and calls the same methods in the same
    order (several of them are collectives).

    ``cfg``: the run's config (``None``: the schema's defaults, e.g. outside orch). ``ctx``: who this worker is
    (default: torchrun's environment; a lone process is rank 0 of 1). ``run_dir``: where events and metrics go
    (``None``: nowhere). The keyword options override the config where given:

    - ``checkpoint_url``: where checkpoints go (default ``checkpoint.url``, else ``<run_dir>/checkpoints``; with
      neither, nothing is checkpointed and nothing restored);
    - ``max_steps`` (``trainer.max_steps``), ``every_n_steps`` (``checkpoint.every_n_steps``: periodic saves,
      0 = only the final one), ``log_every`` (``trainer.log_every``), ``seed`` (``trainer.seed``: seeds the RNGs
      of ranks a checkpoint did not have);
    - ``device``: ``cpu`` or ``cuda`` (default ``cluster.device``; without a config, CUDA when available);
    - ``step_timer``: keep a :class:`~orchestrator.runtime.timing.StepTimer` as ``timer`` (mark its phases and
      register it with DDP) whose per-phase breakdown each metrics record then carries;
    - ``startup``: the worker's start-up times so far (rank 0 reports them as ``worker_started``).

    A Session joins no process group itself (collectives go over the default group if there is one, and are
    a world of one otherwise): :func:`orchestrator.elastic.init` joins it. Its ``ft`` is the fault-tolerance
    mode's step protocol (:mod:`orchestrator.ft.steps`), called at the same points whatever the mode.
    """

    def __init__(self, cfg: Optional[OrchConfig] = None, ctx: Optional[DistContext] = None,
                 run_dir: Optional[str] = None, *, checkpoint_url: Optional[str] = None,
                 max_steps: Optional[int] = None, every_n_steps: Optional[int] = None,
                 log_every: Optional[int] = None, seed: Optional[int] = None, device: Optional[str] = None,
                 step_timer: bool = False, startup: Optional[StartupTimes] = None):
        self.cfg, self.ctx, self.run_dir = cfg, ctx or DistContext.from_env(), run_dir
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)  # a script may name a run dir of its own (no orch launch made it)
        self.events = WorkerEvents(run_dir, self.ctx)  # writes nothing without a run dir
        trainer = cfg.trainer if cfg is not None else TrainerConfig()
        ckpt = cfg.checkpoint if cfg is not None else CheckpointConfig()
        if every_n_steps is not None:
            ckpt = replace(ckpt, every_n_steps=every_n_steps)
        self.max_steps: int = trainer.max_steps if max_steps is None else max_steps
        """Optimizer steps to train for (``trainer.max_steps``)."""
        self.every_n_steps: int | str = ckpt.every_n_steps
        """Periodic checkpoint interval in steps (``checkpoint.every_n_steps``; 0: only the final save; ``auto``)."""
        self.seed: int = trainer.seed if seed is None else seed
        self.checkpoint_url = checkpoint_url or ckpt.url or (f"{run_dir}/checkpoints" if run_dir is not None else None)
        if device is None:
            device = cfg.cluster.device if cfg is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device: torch.device = select_device(device, self.ctx.local_rank)
        self.timer = timer_for(self.device) if step_timer else NullStepTimer()
        self.startup = startup or StartupTimes()
        self.progress = Progress()
        self.state = TrainingState(self.progress)
        engine = checkpoint_engine(ckpt, getattr(cfg, "parallelism", None))
        self.checkpoints = (SessionCheckpoints(ckpt, self.checkpoint_url, self.state, self.ctx, self.device, self.seed,
                                               self.events.write_main, run_dir=run_dir, engine=engine)
                            if self.checkpoint_url else None)
        self.trackers = open_trackers_rank0(cfg, run_dir, self.ctx.rank) if self.ctx.is_main else None
        self.log_every: int = trainer.log_every if log_every is None else log_every
        """A metrics record every N steps (and at ``max_steps``)."""
        self.metrics = MetricsLog(run_dir, self.ctx, self.device, self.timer, self.max_steps, self.log_every,
                                  self.trackers, across=lambda means: self.ft.mean_across_groups(means))
        self._preemption_cfg = cfg.preemption if cfg is not None else PreemptionConfig()
        self.preemption: Optional[PreemptionResponse] = None  # watching from register()/restore() on
        self.sampler: Optional[GlobalBatchSampler] = None
        self.heartbeat: Optional[Heartbeat] = None
        self._comm_at_step_start = 0.0
        self._restored = self._started = False
        self._attempt_steps = 0
        self._discarded = False
        self._step_start = time.perf_counter()
        self._result: Optional[dict[str, Any]] = None
        self.owns_process_group = False  # set by init(): the session then destroys it on exit
        self._strategy: Optional[Strategy] = None
        self.ft: StepProtocol = step_protocol(cfg, self.ctx, self.device, self.max_steps)
        """The fault-tolerance mode's step protocol; attached to the state at register()."""

    # -- who and where ----------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def distributed(self) -> bool:
        """Whether a process group exists (wrap the model in DDP then)."""
        return collectives.grouped()

    @property
    def step(self) -> int:
        """Optimizer steps completed (restored ones included)."""
        return self.progress.step

    @property
    def samples_consumed(self) -> int:
        """Global samples trained on so far: the data position to resume at."""
        return self.progress.samples_consumed

    def sync_gradients(self) -> None:
        """Average the gradients now over what the process group does not span (the other replica groups, in
        a mode where each node is one), e.g. before clipping them without a grad scaler; otherwise a no-op (DDP
        averaged them in the backward pass). A registered optimizer's ``step()`` and grad scaler's
        ``unscale_()`` call it for you."""
        self.ft.sync_gradients()

    # -- before the first step --------------------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        """The run's parallelism strategy (``parallelism.strategy``; ``ddp`` without a config): after
        :meth:`wrap`, its ``no_sync(model)``, ``clip_grad_norm_(model, max_norm)`` and ``grad_scaler(...)``
        are the ones that fit the wrapped model."""
        if self._strategy is None:
            self._strategy = strategy_for(self.cfg)
        return self._strategy

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` on this worker's device, spread over the ranks as the run's ``parallelism.strategy`` says
        (DDP, or FSDP2's ``fully_shard`` per block: docs/sharded.md); returns the module to call forward on.
        Build the optimizer over the returned module's parameters (a sharded strategy turns them into DTensors)
        and register that module. Without a process group (a lone process) the model is returned unwrapped;
        without a run config the strategy is ``ddp``. Every rank calls it."""
        model = model.to(self.device)
        if not self.distributed:
            return model
        return self.strategy.wrap(model, self.ctx, self.device, timer=self.timer,
                                  **handoff_kwargs(self.ft.gradient_handoff()))

    def register(self, states: Optional[Mapping[str, Any]] = None, **named: Any) -> None:
        """Checkpoint these ``Stateful`` objects (``state_dict``/``load_state_dict``) under their names:
        ``register(model=m, optim=o)`` or torchtitan's ``register({"model": m, "train_state": s})``. A DDP or
        compiled module is saved unwrapped. Rank 0's state is the one saved: register what is identical on every
        rank (model, optimizer, scheduler, grad scaler under DDP). Call before :meth:`restore`."""
        if self._restored:
            raise RuntimeError("session.register() after restore(): the checkpoint is already loaded. Fix: register "
                               "every state before session.restore() (or before iterating session.steps())")
        self.state.register({**(states or {}), **named})
        self.startup.mark("model")
        self.ft = self.ft.attach(self.state, self.events.emit, Record(self.metrics.window_state,
                                                               self.metrics.load_window_state))
        self._watch()

    def _watch(self) -> None:
        """Start watching for preemption notices once the model is built, as the built-in trainer always has: a
        SIGTERM before then (while joining the process group, say) keeps its default action. The heartbeat
        starts here too: the controller's hang detection (``hang.enabled``) and its recovery check read it."""
        if self.heartbeat is None and self.run_dir is not None and self.cfg is not None:
            self.heartbeat = Heartbeat(self.run_dir, self.ctx, self.cfg.hang.heartbeat_interval_s)
        if self.preemption is None:
            self.preemption = PreemptionResponse(self._preemption_cfg, self.ctx, self.run_dir, self.device,
                                                 self.progress, self.checkpoints, self.events.write, ft=self.ft)

    def fingerprint(self, settings: Mapping[str, Any]) -> None:
        """Keep a short hash of each of these settings (values that change the math but not the shapes: learning
        rate, global batch, seed, ...) in every checkpoint; resuming under other values warns and records
        ``checkpoint_config_changed`` naming them. Values are hashed as JSON (dataclasses as dicts). Call before
        :meth:`restore`."""
        if self.checkpoints is not None:
            self.checkpoints.fingerprint = hash_settings(settings)

    def restore(self) -> int:
        """Load the newest valid checkpoint (per ``checkpoint.resume``) into the registered states; returns the
        step it holds, the number of steps already done (0: a fresh start). Every rank calls it."""
        if not self._restored:
            self._watch()
            if not self.ft.heal():  # a live peer had the state: storage is not read
                if self.checkpoints is not None:
                    self.checkpoints.restore()
                self.ft.restored(self.progress.step)
            self._restored = True
            self.startup.mark("restore")
            self._start_window()
        return self.progress.step

    def _start_window(self) -> None:
        """Metrics windows start now, unless a peer handed this worker the run's open window with its state."""
        if not self.metrics.window_loaded:
            self.metrics.start()

    def global_batch_sampler(self, dataset_len: int, global_batch: int, micro_batch: int, *,
                             seed: Optional[int] = None, drop_last: bool = True) -> GlobalBatchSampler:
        """This rank's batch sampler (for ``DataLoader(batch_sampler=...)``), starting at the restored data
        position: the global batch stays ``global_batch`` at every world size (``accumulation_steps`` =
        global / (micro x world) micro-batches per step) and the order of samples is the same at every world
        size, so a resumed run sees exactly what an uninterrupted one would. :meth:`step_done` then counts
        ``global_batch`` samples per step and the epoch. Restores first if :meth:`restore` was not called."""
        self.restore()
        self.sampler = GlobalBatchSampler(dataset_len, global_batch, micro_batch, self.world_size, self.rank,
                                          seed=self.seed if seed is None else seed,
                                          start_sample=self.progress.samples_consumed, drop_last=drop_last,
                                          membership=self.ft.membership())
        return self.sampler

    def steps(self) -> Iterator[int]:
        """The steps still to train, ``step + 1 .. max_steps``; restores first if :meth:`restore` was not called.
        Call :meth:`step_done` once at the end of every step."""
        self.restore()
        self._start()
        while self.progress.step < self.max_steps:
            self.ft.begin_step()  # may heal: the step to train is known after it
            if self.progress.step >= self.max_steps:
                break
            step = self.progress.step + 1
            self._step_start = time.perf_counter()
            self.timer.mark()
            yield step
            if self._discarded and self.progress.step == step - 1:
                continue  # a discarded step is trained again, with the same samples
            if self.progress.step != step:
                raise RuntimeError(f"session.steps() yielded step {step} but session.step_done() was called "
                                   f"{self.progress.step - step + 1} times for it. Fix: call it once at the end of "
                                   "every step")

    def _start(self, late: bool = False) -> None:
        """Rank 0 writes ``worker_started``: each start-up milestone's latest time over all ranks (goodput splits
        a recovery by them). One small all_gather per attempt; the first step would wait for the slowest rank
        anyway."""
        if self._started:
            return
        self._started = True
        self.startup.mark("ready")
        self.events.write_main(worker_started(self.startup, self.ctx, self.progress.step, self.max_steps))
        if not late:
            self._start_window()

    # -- every step -------------------------------------------------------------------------------------------
    def step_done(self, loss: Any = None, *, samples: Optional[int] = None,
                  metrics: Optional[Mapping[str, Any]] = None) -> None:
        """The step boundary, on every rank: count the step, log metrics (every ``log_every`` steps: ``loss`` and
        ``metrics``, floats or one-element tensors, averaged over ranks), agree on a preemption notice (then
        save and raise :class:`PreemptedExit`), save periodically. ``samples``: global samples this step trained
        on (default: the global batch of :meth:`global_batch_sampler`; else none, and the record's
        samples/s is None: no throughput shown, never 0)."""
        if not self._restored:
            raise RuntimeError("session.step_done() before restore(): a resumed run would train its steps again. Fix: "
                               "call session.restore() before the first step, or iterate session.steps()")
        self._start(late=True)
        self._discarded = not self.ft.end_step()
        if self._discarded:
            return
        if samples is None:
            samples = self.sampler.G if self.sampler is not None else 0
        p = self.progress
        p.step += 1
        p.samples_consumed += samples
        if self.sampler is not None:
            p.epoch = self.sampler.epoch_of(p.samples_consumed)
        self._attempt_steps += 1
        if self.heartbeat is not None:
            step_s = time.perf_counter() - self._step_start
            comm_s = self.timer.comm_seconds - self._comm_at_step_start
            self.heartbeat.step_done(p.step, step_s, max(0.0, step_s - comm_s))
        if self._attempt_steps == 1:  # what recovery times (MTTR) end on
            self.events.write_main(first_step(self.ctx, p.step))
        window = self.ft.window_rolled() if self.metrics.due(p.step) else None
        self.metrics.step_done(p.step, samples, time.perf_counter() - self._step_start, loss, metrics,
                               lambda: self._fields(window))
        try:
            self.preemption.check()  # raises PreemptedExit after the emergency checkpoint (watching since restore)
        except PreemptedExit:
            self._close_trackers()
            raise
        self.timer.mark()
        if self.checkpoints is not None:
            self.checkpoints.maybe_save()
        self.timer.lap("checkpoint")
        self._step_start = time.perf_counter()
        self._comm_at_step_start = self.timer.comm_seconds

    @property
    def committed(self) -> bool:
        """Whether the last step counted (always, except a step the fault-tolerance mode discarded)."""
        return not self._discarded

    def _fields(self, window: Optional[dict[str, float]] = None) -> dict[str, Any]:
        """``lr`` (the first registered LR scheduler's, else optimizer's), ``grad_scale`` (an enabled scaler's)
        and ``ft`` (the fault-tolerance mode's seconds in the window, ``window``)."""
        components = list(self.state.components.values())
        lrs = [o.get_last_lr()[0] for o in components if hasattr(o, "get_last_lr")]
        lrs += [o.param_groups[0]["lr"] for o in components if isinstance(o, torch.optim.Optimizer)]
        scales = [o.get_scale() for o in components if isinstance(o, torch.amp.GradScaler) and o.is_enabled()]
        return {"lr": lrs[0] if lrs else None, "grad_scale": scales[0] if scales else None, "ft": window}

    # -- the end ----------------------------------------------------------------------------------------------
    def finish(self, **fields: Any) -> dict[str, Any]:
        """After the last step, on every rank: the final checkpoint (unless this step is saved), wait for writes,
        and rank 0 records ``training_finished`` with ``steps_completed``, ``final_loss``, ``params_sha256`` (of the
        first registered module), ``world_size``, ``progress`` and ``fields``. Returns that record; idempotent."""
        if self._result is not None:
            return self._result
        if self.preemption is not None:
            self.preemption.stop()
        self._stop_heartbeat()
        if self.checkpoints is not None:
            self.checkpoints.finish()
        self.ft.shutdown()
        finished = training_finished(self.ctx, self.progress.step, self.metrics.last_loss, self.state.first_model(),
                                     progress=asdict(self.progress), extra=fields)
        self.events.write_main(finished)
        result = finished.fields()
        self._close_trackers()
        self._result = result
        return result

    def _close_trackers(self) -> None:
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            self.metrics.trackers = None
            trackers.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Leaving the ``with`` block: :meth:`finish` if it ended normally; on :class:`PreemptedExit` under
        torchrun, exit with 75 at once; on an error, rank-tagged ``worker_failed`` and torchrun's error file."""
        if exc is None:
            self.finish()
        elif isinstance(exc, PreemptedExit):
            self._close_trackers()
            if "TORCHELASTIC_RUN_ID" in os.environ:
                # Not a failure: the emergency checkpoint is committed and every rank passed the barrier after it;
                # events and metrics are appended line by line. Leave now: a torch interpreter's teardown takes
                # 1-2 s on a busy node, and the survivors' restart waits for this exit.
                self._stop_heartbeat()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exc.code)
        elif not isinstance(exc, SystemExit) or exc.code:
            self._close_trackers()
            report_failure(self.events, self.ctx, exc_type, exc, tb)
        self.close()
        return False

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            heartbeat, self.heartbeat = self.heartbeat, None
            heartbeat.stop()

    def close(self) -> None:
        """Destroy the process group if :func:`init` created it."""
        self._stop_heartbeat()
        if self.owns_process_group and collectives.grouped():
            torch.distributed.destroy_process_group()
        self.owns_process_group = False


def report_failure(events: WorkerEvents, ctx: DistContext, exc_type, exc, tb) -> None:
    """``worker_failed`` naming this rank (the launcher names the earliest failing rank as the root cause), and
    torchrun's error file (its summary then names the rank too)."""
    events.write(worker_failed(ctx, exc_type, exc, tb))
    if "TORCHELASTIC_ERROR_FILE" in os.environ and isinstance(exc, Exception):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)


def _ignore(*args: Any, **kwargs: Any) -> None:
    pass


def open_trackers_rank0(cfg: Optional[OrchConfig], run_dir: Optional[str], rank: int) -> Any:
    """Rank 0's experiment trackers (the ``logger`` config group, orchestrator/tracking/), with the run's config
    logged; None outside an orch run (no config or no run dir)."""
    if cfg is None or run_dir is None:
        return None
    from orchestrator.tracking import open_trackers  # only rank 0 of an orch run needs it

    trackers = open_trackers(cfg, run_dir, rank)
    trackers.log_config(cfg)
    return trackers
