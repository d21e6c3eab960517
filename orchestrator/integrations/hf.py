"""orch for Hugging Face ``transformers.Trainer`` scripts: :class:`OrchCallback`, :func:`orch_training_args` and
:class:`OrchTrainer`.

    from orchestrator.integrations.hf import OrchCallback, latest_checkpoint, orch_training_args

    args = orch_training_args(learning_rate=1e-3)           # output_dir, max_steps, save_steps from the run
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[OrchCallback()])
    trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))

That is ``fault_tolerance.mode=restart``. Building :class:`OrchTrainer` instead of ``Trainer`` (same arguments) runs
either mode: the Trainer itself in restart mode, and under ``per_step`` a loop of orchestrator.elastic's that steps
the Trainer's optimizer through the quorum (:mod:`orchestrator.integrations.hf_per_step`).

A model whose loss is already a mean (``BertForMaskedLM``) goes through :func:`averages_its_own_loss` first:
transformers would scale its loss and gradients by world size x accumulation otherwise.

In restart mode checkpoints are HF's own (``checkpoint-<step>/`` under ``<checkpoint.url or run
dir/checkpoints>/hf``), so HF's resume (optimizer, scheduler, RNG, data position) is used unchanged. HF writes a
checkpoint file by file and nothing says when it is done, so the callback marks one complete
(``orch_complete.json``, written by rank 0 after every rank's part is written) and :func:`latest_checkpoint` only
returns marked ones: a save cut short is never resumed from.

Preemption is orchestrator.elastic's (orchestrator/elastic/preemption.py): the same notice sources, the same
all-reduce at every step boundary (``on_step_end``). On a notice every rank saves (HF's save of that step),
rank 0 marks it complete, every rank passes a barrier, and the worker exits with 75 (the noticed node's agent
is stopped, as for elastic users). A SIGTERM that is no notice (torchrun restarting the workers after a
membership change) is agreed at the next boundary and every rank leaves without saving; a save in progress
then is finished first (HF saves synchronously inside the step), so no checkpoint is torn by a restart.

Rank 0 writes the run's ``metrics.jsonl`` (one record per HF logging step: step, loss, lr, world_size, samples/s,
step time) and the events goodput needs (``rendezvous_complete``, ``worker_started``, ``first_step``,
``checkpoint_saved``/``checkpoint_loaded``, ``emergency_checkpoint``, ``training_finished``). Outside orch (no
``ORCH_RUN_DIR``) nothing is written and every SIGTERM is a notice, as in orchestrator.elastic.

This module imports ``transformers``; ``import orchestrator`` does not import this module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from orchestrator.checkpoint.hf_dirs import COMPLETE_MARKER, HF_SUBDIR, hf_checkpoints
from orchestrator.config.compose import load_run_config
from orchestrator.config.schema import OrchConfig, PreemptionConfig
from orchestrator.elastic import collectives
from orchestrator.elastic.metrics import flatten, progress_line
from orchestrator.elastic.preemption import PreemptedExit, PreemptionResponse
from orchestrator.elastic.session import open_trackers_rank0
from orchestrator.elastic.worker_events import (WorkerEvents, emergency_checkpoint, first_step, training_finished,
                                                worker_started)
from orchestrator.errors import ConfigError
from orchestrator.events import CheckpointLoaded, CheckpointSaved
from orchestrator.ft.steps import StepProtocol
from orchestrator.ft.worker import step_protocol
from orchestrator.integrations.hf_loss import _loss_scaled_by_trainer, warn_if_loss_scaled  # noqa: F401
from orchestrator.preemption.notices import SIGTERM_SOURCE
from orchestrator.rundir import CONFIG_FILE, METRICS_FILE, append_jsonl
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Progress
from orchestrator.runtime.timing import StartupTimes

RUN_DIR_ENV = "ORCH_RUN_DIR"


# -- where the run is ---------------------------------------------------------------------------------------------
def orch_run_dir() -> Optional[str]:
    """The run dir orch gave this worker (``$ORCH_RUN_DIR``); None outside orch."""
    return os.environ.get(RUN_DIR_ENV) or None


def run_config(directory: Optional[str] = None) -> Optional[OrchConfig]:
    """The run's config (``<run dir>/config.yaml``), None outside orch."""
    directory = directory or orch_run_dir()
    if directory is None or not (Path(directory) / CONFIG_FILE).exists():
        return None
    return load_run_config(str(Path(directory) / CONFIG_FILE))


def checkpoint_dir(cfg: Optional[OrchConfig] = None, directory: Optional[str] = None) -> Optional[str]:
    """Where HF checkpoints of this run go: ``<checkpoint.url>/hf``, else ``<run dir>/checkpoints/hf`` (the run dir:
    ``directory``, else ``$ORCH_RUN_DIR``, else ``run.dir``); None outside orch. HF writes to a filesystem only: a remote ``checkpoint.url`` (``s3://``...) is refused."""
    directory = directory or orch_run_dir() or (cfg.run.dir if cfg is not None else None)
    url = cfg.checkpoint.url if cfg is not None else None
    if url:
        if "://" in url and not url.startswith("file://"):
            raise ValueError(f"checkpoint.url={url!r}: transformers.Trainer saves to a filesystem path only. Fix: set "
                             "checkpoint.url to a local or shared-filesystem path, or pass output_dir= yourself")
        return str(Path(url.removeprefix("file://")) / HF_SUBDIR)
    return str(Path(directory) / "checkpoints" / HF_SUBDIR) if directory is not None else None


def latest_checkpoint(output_dir: Optional[str]) -> Optional[str]:
    """The newest ``checkpoint-<step>`` under ``output_dir`` marked complete (:data:`COMPLETE_MARKER`), for
    ``trainer.train(resume_from_checkpoint=...)``; None when there is none (a fresh start)."""
    complete = [c for c in hf_checkpoints(output_dir) if c.complete]
    return complete[-1].path if complete else None


def orch_training_args(cfg: Optional[OrchConfig] = None, **kwargs: Any) -> TrainingArguments:
    """``TrainingArguments(**kwargs)`` with what the run's config says filled in where ``kwargs`` does not:

    ``output_dir`` (:func:`checkpoint_dir`), ``max_steps`` (``trainer.max_steps``), ``save_strategy="steps"`` and
    ``save_steps`` (``checkpoint.every_n_steps``; 0: only the final save), ``save_total_limit``
    (``checkpoint.keep_last``), ``logging_steps`` (``trainer.log_every``), ``seed`` (``trainer.seed``),
    ``per_device_train_batch_size`` (``trainer.micro_batch_size``) and ``gradient_accumulation_steps`` (so the
    global batch is ``trainer.global_batch_size`` at this world size, when it divides), ``use_cpu`` and
    ``ddp_backend`` (``cluster.device``, ``backend.name``), ``disable_tqdm`` (orch prints a progress line per
    record), ``report_to="none"``. Outside orch only
    ``report_to`` is filled in (pass ``output_dir``)."""
    cfg = cfg if cfg is not None else run_config()
    filled: dict[str, Any] = {"report_to": "none"}
    if cfg is not None:
        t, ckpt = cfg.trainer, cfg.checkpoint
        world = int(os.environ.get("WORLD_SIZE", 1))
        if ckpt.every_n_steps == "auto":  # the Trainer's save_steps is fixed when it is built
            raise ConfigError("checkpoint.every_n_steps", "auto", "set a number of steps for transformers.Trainer",
                              "is not supported by the transformers.Trainer integration")
        refuse_sharded(cfg)
        every = ckpt.every_n_steps if ckpt.every_n_steps > 0 else t.max_steps
        filled.update(output_dir=checkpoint_dir(cfg), max_steps=t.max_steps, save_strategy="steps", save_steps=every,
                      logging_steps=t.log_every, seed=t.seed, per_device_train_batch_size=t.micro_batch_size,
                      use_cpu=cfg.cluster.device == "cpu", disable_tqdm=True,
                      dataloader_pin_memory=cfg.cluster.device != "cpu")
        if world > 1:  # accelerate would set up a process group for a named backend even in a world of one
            filled["ddp_backend"] = cfg.backend.name
        if ckpt.keep_last and ckpt.keep_last >= 2:  # 1 could delete the only complete checkpoint during a save
            filled["save_total_limit"] = ckpt.keep_last
        accumulation = accumulation_steps(cfg, world)
        if accumulation is not None:
            filled["gradient_accumulation_steps"] = accumulation
    return TrainingArguments(**{**filled, **kwargs})


def refuse_sharded(cfg: Optional[OrchConfig]) -> None:
    """The Trainer wraps its model itself (DDP, or FSDP through accelerate's plugin: TrainingArguments ``fsdp``)
    and saves its own checkpoints, so orch's sharded strategies are not applied to it: refused in one line
    rather than training unsharded under a config that says otherwise."""
    if cfg is not None and cfg.parallelism.strategy != "ddp":
        raise ConfigError("parallelism.strategy", cfg.parallelism.strategy, "use parallelism.strategy=ddp with "
                          "transformers.Trainer (to shard it, pass TrainingArguments fsdp=... to accelerate's FSDP "
                          "plugin yourself)", "is not applied by the transformers.Trainer integration: the Trainer "
                          "wraps its model and writes its checkpoints itself")


def averages_its_own_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Tells ``transformers.Trainer`` that ``model`` returns a mean loss and ignores ``num_items_in_batch``
    (``BertForMaskedLM`` and other heads that call ``CrossEntropyLoss()`` themselves); returns ``model``.

    Why: the Trainer takes a ``forward(**kwargs)`` for one that sums its loss over the batch's tokens, so it
    neither divides by ``gradient_accumulation_steps`` nor undoes its multiplication by the world size, and both
    the logged loss and the gradients come out ``world size x accumulation`` times too large (orch sets both to
    keep ``trainer.global_batch_size``). Call it before building the Trainer."""
    model.accepts_loss_kwargs = False
    return model


def accumulation_steps(cfg: OrchConfig, world_size: int) -> Optional[int]:
    """Micro-batches per optimizer step that keep ``trainer.global_batch_size`` at ``world_size`` ranks of
    ``trainer.micro_batch_size``; None when it does not divide (HF's default of 1 then)."""
    t = cfg.trainer
    if t.global_batch_size and t.global_batch_size % (t.micro_batch_size * world_size) == 0:
        return t.global_batch_size // (t.micro_batch_size * world_size)
    return None


PROGRESS_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"
"""Set (to 0 to keep them, 1 to hide them) and the Hugging Face progress bars are left as it says under orch."""


def quiet_progress_bars() -> None:
    """No tqdm bars from transformers or huggingface_hub in this process ("Writing model shards" at every save):
    under orch each worker's output is a log, where a bar is a line per refresh. OrchCallback calls it under orch
    unless :data:`PROGRESS_BARS_ENV` is set."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# -- the callback ------------------------------------------------------------------------------------------------
class _SaveThenLeave(Exception):
    """The ranks agreed on a notice: HF must save this step before the worker leaves."""

    def __init__(self, notice_t: float):
        super().__init__(notice_t)
        self.notice_t = notice_t


class _HFPreemption(PreemptionResponse):
    """orchestrator.elastic's agreement, with the save left to the Trainer: on an agreed notice :meth:`check`
    raises :class:`_SaveThenLeave` instead of saving through orch's CheckpointManager."""

    def _save_and_leave(self, notice_t: float) -> None:
        raise _SaveThenLeave(notice_t)


class OrchCallback(TrainerCallback):
    """Gives a ``transformers.Trainer`` orch's preemption handling, metrics and goodput events (see the module
    docstring). Every rank has one (pass it in ``callbacks=[OrchCallback()]``). ``run_dir``: default
    ``$ORCH_RUN_DIR`` (None outside orch: nothing is written). ``cfg``: default the run's config.
    ``exit_on_preemption``: leave the process with 75 under torchrun once the emergency save is committed
    (default); False raises :class:`~orchestrator.elastic.PreemptedExit` out of ``trainer.train()`` instead,
    as it always does outside torchrun."""

    def __init__(self, run_dir: Optional[str] = None, cfg: Optional[OrchConfig] = None, *,
                 exit_on_preemption: bool = True):
        self.run_dir = run_dir if run_dir is not None else orch_run_dir()
        self.cfg = cfg if cfg is not None else run_config(self.run_dir)
        refuse_sharded(self.cfg)
        if self.run_dir is not None and PROGRESS_BARS_ENV not in os.environ:
            quiet_progress_bars()
        self.ctx = DistContext.from_env()
        self.events = WorkerEvents(self.run_dir, self.ctx)  # most events: rank 0's only
        self.startup = StartupTimes()
        self.startup.mark("imports")
        self.exit_on_preemption = exit_on_preemption
        self.progress = Progress()
        self.ft: StepProtocol = step_protocol(self.cfg, self.ctx, torch.device("cpu"))
        """The fault-tolerance mode's step protocol: the round's record and, on a notice, whether peers hold the
        state. The Trainer's own loop steps the optimizer, so only modes without step hooks are followed here
        (under per_step :class:`OrchTrainer` runs a loop of its own without this callback; in a plain Trainer
        :meth:`on_train_begin` refuses per_step)."""
        self.preemption: Optional[PreemptionResponse] = None
        self.trackers = None
        self.leaving: Optional[float] = None
        """The agreed notice's time once the ranks agreed to save and leave."""
        self._attempt_steps = 0
        self._window = (time.perf_counter(), 0)  # (start, steps) of the current metrics window
        self._step_start = time.perf_counter()
        self._last_step_s = 0.0
        self._save_start: Optional[float] = None
        self._last_loss: Optional[float] = None
        self._finished = False

    # -- start ----------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        """Every rank: watch for notices; rank 0 records the round (``rendezvous_complete``, ``restart``), the
        resumed checkpoint and ``worker_started`` (start-up milestones, latest over ranks)."""
        self.ctx = self.events.ctx = DistContext.from_env()
        self.progress.step = state.global_step
        if self.cfg is not None and self.cfg.fault_tolerance.mode == "per_step" and self.run_dir is not None:
            # The Trainer's own loop steps the optimizer and counts every step whatever the quorum says.
            raise ConfigError("fault_tolerance.mode", "per_step", "build it as orchestrator.integrations.hf."
                              "OrchTrainer(...) instead of transformers.Trainer(...) (same arguments), or use "
                              "fault_tolerance.mode=restart", "needs OrchTrainer's per_step loop: the "
                              "transformers.Trainer loop cannot train a step through the quorum")
        warn_if_loss_scaled(kwargs.get("model"), args.gradient_accumulation_steps * self.ctx.world_size,
                            self.ctx.is_main)
        preemption_cfg = self.cfg.preemption if self.cfg is not None else PreemptionConfig()
        if self.preemption is None:
            self.preemption = _HFPreemption(preemption_cfg, self.ctx, self.run_dir, args.device, self.progress,
                                            None, self.events.write, ft=self.ft)
        self.startup.mark("model")
        self.ft.record_start(self.events.emit, self.ctx)
        if self.ctx.is_main:
            if state.global_step:
                self.events.write(CheckpointLoaded(step=state.global_step, world_size=self.ctx.world_size, source="hf"))
            self.trackers = open_trackers_rank0(self.cfg, self.run_dir, self.ctx.rank)
        self.startup.mark("restore")
        self.startup.mark("ready")
        self.events.write_main(worker_started(self.startup, self.ctx, state.global_step, state.max_steps))
        self._window = (time.perf_counter(), 0)
        self._step_start = time.perf_counter()
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()
        return control

    # -- the step boundary ----------------------------------------------------------------------------------------
    def on_step_end(self, args, state, control, **kwargs):
        """Every rank, after each optimizer step: count it, then agree on notices (a notice: save this step and
        stop; torchrun restarting the workers: leave now, before any save starts)."""
        self._last_step_s = time.perf_counter() - self._step_start
        self.progress.step = state.global_step
        start, steps = self._window
        self._window = (start, steps + 1)
        self._attempt_steps += 1
        if self._attempt_steps == 1:
            self.events.write_main(first_step(self.ctx, state.global_step))
        if self.preemption is not None:
            try:
                self.preemption.check()  # os._exit()s on an agreed torchrun restart
            except _SaveThenLeave as agreed:
                self.leaving = agreed.notice_t
                control.should_save = True
                control.should_training_stop = True
        if control.should_save:
            self._save_start = time.perf_counter()
            if self.ctx.is_main:  # a directory saved again (after a resume from an older one) is incomplete until
                self._unmark(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))  # marked again
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Rank 0: a ``metrics.jsonl`` record for each of HF's training logs (its loss is already averaged over
        ranks and over the steps since its previous log)."""
        logs = logs or {}
        if "loss" not in logs or not self.ctx.is_main:
            return control
        now = time.perf_counter()
        start, steps = self._window
        self._window = (now, 0)
        if steps == 0:
            return control
        window_s = now - start
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.ctx.world_size
        self._last_loss = float(logs["loss"])
        record = {"t": time.time(), "step": state.global_step, "loss": self._last_loss,
                  "lr": logs.get("learning_rate"), "world_size": self.ctx.world_size,
                  "samples_per_s": batch * steps / window_s if window_s > 0 else 0.0,
                  "step_time_s": window_s / steps, "last_step_time_s": self._last_step_s,
                  "restart_count": self.ctx.restart_count}
        if logs.get("grad_norm") is not None:
            record["grad_norm"] = float(logs["grad_norm"])
        if self.run_dir is not None:
            append_jsonl(Path(self.run_dir) / METRICS_FILE, record)
            print(progress_line(record, self.ctx.rank, state.max_steps), flush=True)
        if self.trackers is not None:
            self.trackers.log_metrics(state.global_step, flatten(record))
        return control

    def on_save(self, args, state, control, **kwargs):
        """Every rank, after HF's save: once all ranks wrote their part, rank 0 marks the checkpoint complete. After
        an agreed notice: every rank waits for that mark, then leaves with 75."""
        collectives.barrier()  # every rank's files (its RNG state at least) are written
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        save_s = time.perf_counter() - self._save_start if self._save_start is not None else 0.0
        self._save_start = None
        if self.ctx.is_main:
            self._mark(folder, state.global_step, "preemption" if self.leaving is not None else "periodic")
            self.events.write(CheckpointSaved(step=state.global_step, path=folder, stall_s=save_s, write_s=0.0,
                                              reason="preemption" if self.leaving is not None else "periodic",
                                              source="hf"))
        if self.leaving is not None:
            self.events.write_main(emergency_checkpoint(state.global_step, save_s, self.leaving))
            collectives.barrier()  # nobody leaves before the checkpoint is marked complete
            self._leave(state.global_step)
        return control

    def _leave(self, step: int) -> None:
        """As orchestrator.elastic does after an emergency checkpoint: the noticed node stops its agent (it leaves
        the job), then the worker exits with 75."""
        self._close_trackers()
        watcher = self.preemption.watcher if self.preemption is not None else None
        notice = watcher.notice if watcher is not None else None
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ
        if notice is not None and notice.source != SIGTERM_SOURCE and self.ctx.local_rank == 0 and under_agent:
            os.kill(os.getppid(), signal.SIGTERM)
        if under_agent and self.exit_on_preemption:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PreemptedExit(step).code)  # the torchrun restart waits for this exit; skip the teardown
        raise PreemptedExit(step)

    # -- the end --------------------------------------------------------------------------------------------------
    def on_train_end(self, args, state, control, model=None, **kwargs):
        """Every rank: stop watching; rank 0 records ``training_finished`` (``steps_completed`` = HF's
        ``global_step``, ``final_loss``, ``params_sha256`` of the model, ``world_size``)."""
        if self.preemption is not None:
            self.preemption.stop()
        if self._finished:
            return control
        self._finished = True
        if self.ctx.is_main:
            self.events.write(training_finished(self.ctx, state.global_step, self._last_loss,
                                                model if isinstance(model, torch.nn.Module) else None))
        self._close_trackers()
        return control

    def _close_trackers(self) -> None:
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            trackers.close()

    # -- completeness marks ---------------------------------------------------------------------------------------
    def _mark(self, folder: str, step: int, reason: str) -> None:
        if not os.path.isdir(folder):
            return  # HF saved nothing here (a process that should not save); nothing to mark
        tmp = os.path.join(folder, f".{COMPLETE_MARKER}.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, "world_size": self.ctx.world_size, "reason": reason, "t": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, COMPLETE_MARKER))

    @staticmethod
    def _unmark(folder: str) -> None:
        try:
            os.remove(os.path.join(folder, COMPLETE_MARKER))
        except FileNotFoundError:
            pass


# -- the Trainer ---------------------------------------------------------------------------------------------------
class OrchTrainer(Trainer):
    """``transformers.Trainer`` that trains under either fault-tolerance mode of an orch run: build it instead of
    ``Trainer`` (same arguments; nothing else changes).

    - ``fault_tolerance.mode=restart`` (and outside orch): it *is* the Trainer, with an :class:`OrchCallback`
      added under orch when ``callbacks`` has none: HF's loop, HF's checkpoints, resume from the newest complete
      one.
    - ``fault_tolerance.mode=per_step``: ``train()`` runs :mod:`orchestrator.integrations.hf_per_step`'s loop (the
      Trainer's optimizer, scheduler, ``training_step`` and callbacks, stepped through the quorum: survivors of a
      lost node go on, a returning node heals from a live peer, the global batch stays ``trainer.global_batch_size``)
      and the session does what :class:`OrchCallback` does in restart mode (the callback is dropped).
      ``resume_from_checkpoint`` is not used there: the state comes from a live peer, else orch's checkpoints.

    ``cfg``/``run_dir``: the run's config and run dir (default: ``$ORCH_RUN_DIR`` and its ``config.yaml``)."""

    def __init__(self, *args: Any, cfg: Optional[OrchConfig] = None, run_dir: Optional[str] = None, **kwargs: Any):
        self.orch_run_dir = run_dir if run_dir is not None else orch_run_dir()
        self.orch_cfg = cfg if cfg is not None else run_config(self.orch_run_dir)
        self.orch_per_step = (self.orch_run_dir is not None and self.orch_cfg is not None
                              and self.orch_cfg.fault_tolerance.mode == "per_step")
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if self.orch_per_step:  # the session does the callback's work; its on_train_begin would refuse per_step
            refuse_sharded(self.orch_cfg)
            callbacks = [c for c in callbacks if not (c is OrchCallback or isinstance(c, OrchCallback))]
            if PROGRESS_BARS_ENV not in os.environ:
                quiet_progress_bars()
        elif self.orch_run_dir is not None and not any(c is OrchCallback or isinstance(c, OrchCallback)
                                                       for c in callbacks):
            callbacks.append(OrchCallback(self.orch_run_dir, self.orch_cfg))
        self.orch_leading_group = True
        """per_step: whether this node's group led the last quorum (set by the loop); only it saves the model."""
        super().__init__(*args, callbacks=callbacks, **kwargs)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """HF's ``train()``; under per_step a ``resume_from_checkpoint`` is set aside with a note (the state comes
        from a live peer, else orch's newest checkpoint, when the loop restores)."""
        if self.orch_per_step and resume_from_checkpoint:
            if self.args.process_index == 0:
                print(f"[orch] per_step: not resuming from {resume_from_checkpoint} (HF checkpoint); the state "
                      "comes from a live peer, else orch's newest checkpoint", flush=True)
            resume_from_checkpoint = None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _inner_training_loop(self, batch_size: Any = None, args: Any = None, resume_from_checkpoint: Any = None,
                             trial: Any = None, ignore_keys_for_eval: Any = None) -> Any:
        """The Trainer's loop in restart mode; under per_step :func:`~orchestrator.integrations.hf_per_step.
        train_per_step` (what ``train()`` calls once the model is set up)."""
        if not self.orch_per_step:
            return super()._inner_training_loop(batch_size=batch_size, args=args,
                                                resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                                ignore_keys_for_eval=ignore_keys_for_eval)
        from orchestrator.integrations.hf_per_step import train_per_step

        return train_per_step(self, self.orch_cfg, self.orch_run_dir)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """HF's ``save_model``; under per_step only the group that led the last quorum writes (every group holds
        the same model, and they would all write the same files at once)."""
        if self.orch_per_step and not self.orch_leading_group:
            return
        super().save_model(output_dir, _internal_call)
