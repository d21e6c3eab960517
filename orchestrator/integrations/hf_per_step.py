"""``transformers.Trainer``'s training loop under ``fault_tolerance.mode=per_step``: what
:class:`orchestrator.integrations.hf.OrchTrainer` runs instead of the Trainer's own loop there.

Why a loop of its own: in per_step every optimizer step is a transaction of the step's quorum (orchestrator/ft/),
and the Trainer's loop cannot follow one. It fixes the gradient accumulation (``gradient_accumulation_steps``) for
the whole run, while the quorum decides at every step how many replica groups share the global batch; it counts a
step (``global_step``, the scheduler, the data position) whether or not the quorum commits it; its data loader is
sharded by accelerate and prefetched one batch ahead, before the step's quorum is known; and it reads its state
from HF's checkpoints only, where a returning group must load a live peer's.

So this loop is :mod:`orchestrator.elastic`'s, with the Trainer's own parts in it: ``create_optimizer``,
``create_scheduler``, ``training_step`` (and so ``compute_loss``, the data collator and any override of them),
accelerate's DDP within the node's group and gradient clipping, the callbacks (``on_train_begin``,
``on_step_begin``, ``on_pre_optimizer_step``, ``on_optimizer_step``, ``on_step_end``, ``on_log``, ``on_train_end``)
and ``trainer.log``. Per step:

- the session joins the step's quorum (a group that is behind loads a live peer's model, optimizer, scheduler,
  data position and RNG there: ``replica_healed``);
- orch's global batch sampler draws this rank's micro-batches by the quorum's world, rank and data position,
  ``global_batch / (micro_batch x world)`` of them, so the global batch is the same at every quorum size;
- ``training_step`` on each micro-batch (DDP syncs inside the group on the last), then the gradients are averaged
  across the quorum's groups before clipping, and the optimizer steps only if the quorum commits;
- a committed step steps the scheduler and counts (``global_step``, ``on_step_end``, a record every
  ``logging_steps``); a discarded one leaves the optimizer, the scheduler, ``global_step``, the data position and
  the RNG states as they were, and the same step is trained again with the same samples.

Checkpoints are orch's (the session's CheckpointManager, every ``checkpoint.every_n_steps``), not HF's
``checkpoint-<step>`` folders: a run that lost every group resumes from them, as the elastic API does.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

import orchestrator.elastic as elastic
from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError
from orchestrator.integrations.hf_loss import warn_if_loss_scaled
from orchestrator.runtime.state import Record


class LossWindow:
    """The loss summed over the committed steps since the last record, registered with the session: a discarded
    step's loss is taken out with the step (the mode puts registered states back), and a healing group takes
    over its peer's, so every group's record is a mean over the same steps, as HF's own logged loss is."""

    def __init__(self) -> None:
        self.total, self.steps = 0.0, 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += float(loss)
        self.steps += 1

    def take(self) -> float:
        """The mean since the last record; the next window starts at zero."""
        mean = self.total / max(1, self.steps)
        self.total, self.steps = 0.0, 0
        return mean

    def record(self) -> Record:
        return Record(lambda: {"total": self.total, "steps": self.steps}, self._load)

    def _load(self, state: dict[str, Any]) -> None:
        self.total, self.steps = float(state["total"]), int(state["steps"])


def check_loop_settings(trainer: Any, cfg: OrchConfig) -> None:
    """What the per_step loop cannot follow, refused in one line before anything starts."""
    args = trainer.args
    if trainer.train_dataset is None:
        raise ValueError("OrchTrainer: training requires a train_dataset")
    if isinstance(trainer.train_dataset, IterableDataset) or not hasattr(trainer.train_dataset, "__len__"):
        raise ConfigError("fault_tolerance.mode", "per_step", "pass a map-style train_dataset (with __len__), or use "
                          "fault_tolerance.mode=restart", "needs a train_dataset with a length: every step's samples "
                          "are a global position in it, drawn by the step's quorum")
    if args.dataloader_num_workers:
        raise ConfigError("dataloader_num_workers", args.dataloader_num_workers, "pass dataloader_num_workers=0 with "
                          "fault_tolerance.mode=per_step", "prefetches batches before the step's quorum says how many "
                          "replica groups share it")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ConfigError("fault_tolerance.mode", "per_step", "use DDP (no deepspeed/fsdp TrainingArguments) with "
                          "fault_tolerance.mode=per_step, or fault_tolerance.mode=restart",
                          "heals a returning group from a live peer's whole state, which the Trainer's "
                          "deepspeed and fsdp engines shard in a layout of their own")


def train_per_step(trainer: Any, cfg: OrchConfig, run_dir: Optional[str]) -> Any:
    """Train ``trainer`` (an :class:`~orchestrator.integrations.hf.OrchTrainer`) to ``max_steps`` under the run's
    per_step quorum; returns HF's ``TrainOutput``. Every rank of every group calls it (from ``trainer.train()``)."""
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput, speed_metrics

    check_loop_settings(trainer, cfg)
    args = trainer.args
    dataset = trainer.train_dataset
    # The job's global batch at every quorum size; each rank's micro-batch is the Trainer's (orch_training_args:
    # trainer.micro_batch_size), and the accumulation follows the quorum (not gradient_accumulation_steps).
    total, micro = cfg.trainer.global_batch_size, args.per_device_train_batch_size
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * (len(dataset) // total))
    log_every = args.logging_steps if args.logging_steps >= 1 else math.ceil(max_steps * args.logging_steps)
    window = LossWindow()
    with elastic.init(cfg, run_dir=run_dir, process_group=False, max_steps=max_steps, log_every=int(log_every),
                      seed=args.seed) as session:  # accelerate joined the group's process group (if any) already
        trainer.create_optimizer()
        model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)  # DDP in the group
        trainer.model_wrapped = model
        trainer.create_scheduler(num_training_steps=max_steps, optimizer=trainer.optimizer)
        states = {"model": trainer.model, "optim": trainer.optimizer, "scheduler": trainer.lr_scheduler,
                  "loss_window": window.record()}
        if getattr(trainer.accelerator, "scaler", None) is not None:  # fp16: accelerate's GradScaler
            states["scaler"] = trainer.accelerator.scaler
        session.register(**states)  # the optimizer steps only on the quorum's commit from now on
        session.restore()  # a live peer's state, else orch's newest checkpoint, else step 0
        sampler = session.global_batch_sampler(len(dataset), total, micro, seed=args.seed)
        batches = iter(DataLoader(_columns_removed(trainer, dataset), batch_sampler=sampler,
                                  collate_fn=_collator(trainer, dataset), num_workers=0,
                                  pin_memory=args.dataloader_pin_memory and session.device.type == "cuda"))
        warn_if_loss_scaled(trainer.model, total // micro, session.is_main)

        state = trainer.state = TrainerState()
        state.max_steps, state.logging_steps = max_steps, int(log_every)
        state.num_train_epochs = math.ceil(max_steps * total / len(dataset))
        state.train_batch_size = micro
        state.global_step = first_step = session.step
        state.is_local_process_zero = args.local_process_index == 0
        state.is_world_process_zero = session.is_main
        control = trainer.control
        control = trainer.callback_handler.on_train_begin(args, state, control)
        started = time.time()
        logged_total, logged_steps = 0.0, 0
        for _ in session.steps():
            state.global_step = session.step  # after a heal: the peer's
            state.is_world_process_zero = session.is_main  # the leading group's rank 0 writes the job's logs
            control = trainer.callback_handler.on_step_begin(args, state, control)
            micro_batches, items = trainer.get_batch_samples(batches, sampler.accumulation_steps, args.device)
            trainer.current_gradient_accumulation_steps = len(micro_batches)
            loss = torch.zeros((), device=args.device)
            for i, inputs in enumerate(micro_batches):
                sync = i == len(micro_batches) - 1  # DDP averages inside the group on the last micro-batch
                with contextlib.nullcontext() if sync else trainer.accelerator.no_sync(model):
                    loss += trainer.training_step(model, inputs, items).detach()
            session.sync_gradients()  # across the quorum's groups, before clipping, as DDP would have
            grad_norm = None
            if args.max_grad_norm and args.max_grad_norm > 0:
                grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            control = trainer.callback_handler.on_pre_optimizer_step(args, state, control)
            trainer.optimizer.step()  # a no-op unless the quorum commits this step
            control = trainer.callback_handler.on_optimizer_step(args, state, control)
            committed = session.ft.commit()
            learning_rate = trainer.lr_scheduler.get_last_lr()[0]  # this step's, as the Trainer logs it
            if committed:
                with warnings.catch_warnings():  # torch's check of its own step() wrapper, which the commit replaced
                    warnings.filterwarnings("ignore", r"Seems like `optimizer\.step\(\)` has been overridden")
                    trainer.lr_scheduler.step()
                window.add(loss)
            model.zero_grad()
            due = session.metrics.due(session.step + 1)
            extra = {"grad_norm": grad_norm} if grad_norm is not None else None
            session.step_done(loss=window.take() if due and committed else loss, metrics=extra)
            if not session.committed:
                continue  # session.steps() trains the same step again, with the same samples
            state.global_step = session.step
            state.epoch = session.samples_consumed / len(dataset)
            control = trainer.callback_handler.on_step_end(args, state, control)
            if due:
                job_loss = session.metrics.last_loss
                logged_total += (job_loss or 0.0) * (session.step - first_step - logged_steps)
                logged_steps = session.step - first_step
                logs = {"loss": job_loss, "learning_rate": learning_rate}
                if grad_norm is not None:
                    logs["grad_norm"] = float(grad_norm)
                trainer.log(logs)
            if control.should_training_stop:
                break
        trained = session.step - first_step
        metrics = speed_metrics("train", started, num_samples=trained * total, num_steps=trained)
        metrics["train_loss"] = logged_total / logged_steps if logged_steps else float("nan")
        trainer.log(metrics)
        trainer.orch_leading_group = session.ctx.leader
        session.finish()
    trainer.control = trainer.callback_handler.on_train_end(args, state, control)
    return TrainOutput(state.global_step, metrics["train_loss"], metrics)


def _columns_removed(trainer: Any, dataset: Any) -> Any:
    """A ``datasets.Dataset`` without the columns the model's forward does not take, as the Trainer's loader has."""
    try:
        import datasets
    except ImportError:
        return dataset
    if isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description="training")
    return dataset


def _collator(trainer: Any, dataset: Any) -> Any:
    """The Trainer's data collator, dropping the columns its forward does not take (any other dataset)."""
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return trainer.data_collator
    except ImportError:
        pass
    return trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")
