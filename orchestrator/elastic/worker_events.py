"""The events a worker writes, in one place for every loop that runs under orch: the session
(orchestrator/elastic/session.py) and the Hugging Face callback (orchestrator/integrations/hf.py) build them
with these helpers and write them through :class:`WorkerEvents`.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Mapping, Optional

import torch

from orchestrator.elastic import collectives
from orchestrator.events import (EmergencyCheckpoint, Event, FirstStep, TrainingFinished, WorkerFailed, WorkerStarted,
                                 event_of)
from orchestrator.rundir import EventLog
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import params_sha256
from orchestrator.runtime.timing import StartupTimes, latest_over_ranks


class WorkerEvents:
    """One worker's writer of the run's events; nothing is written without a run dir (``run_dir`` None).
    ``ctx``: who this worker is (its ``is_main`` may move from step to step: the leading replica group)."""

    def __init__(self, run_dir: Optional[str], ctx: DistContext):
        self.log = EventLog(run_dir) if run_dir is not None else None
        self.ctx = ctx

    def write(self, event: Event) -> None:
        """This rank's event (a failure, a notice its node received)."""
        if self.log is not None:
            self.log.write(event)

    def write_main(self, event: Event) -> None:
        """The run's records come from one worker: rank 0 of the leading group (``ctx.is_main``)."""
        if self.ctx.is_main:
            self.write(event)

    def emit(self, name: str, **fields: Any) -> None:
        """This rank's event, handed over as a name and its fields (the step protocol's ``emit``, which the
        fault-tolerance modes call with an event of orchestrator/events.py: :func:`orchestrator.ft.steps.send`)."""
        self.write(event_of(name, fields))


def worker_started(startup: StartupTimes, ctx: DistContext, step: int,
                   max_steps: Optional[int] = None) -> WorkerStarted:
    """``worker_started`` of an attempt: each start-up milestone's latest time over all ranks, and the step it
    trains to (``max_steps``, when known: the live progress shows step/total and an ETA from it). A collective
    (one small all_gather): every rank calls it, rank 0 writes the event."""
    per_rank = collectives.all_gather_object(startup.fields(), ctx.world_size)
    return WorkerStarted(world_size=ctx.world_size, restart_count=ctx.restart_count, step=step,
                         max_steps=max_steps if max_steps and max_steps > 0 else None,
                         milestones=latest_over_ranks(per_rank))


def first_step(ctx: DistContext, step: int) -> FirstStep:
    """The first step of an attempt completed (recovery times end here); the job's world size."""
    return FirstStep(step=step, world_size=ctx.job_world_size, restart_count=ctx.restart_count)


def emergency_checkpoint(step: int, save_s: float, notice_t: float) -> EmergencyCheckpoint:
    """The checkpoint of ``step`` saved on the notice of ``notice_t`` (unix seconds) is committed now."""
    return EmergencyCheckpoint(step=step, save_s=save_s, since_notice_s=time.time() - notice_t)


def training_finished(ctx: DistContext, steps_completed: int, final_loss: Optional[float],
                      model: Optional[torch.nn.Module], progress: Optional[Mapping[str, Any]] = None,
                      extra: Optional[Mapping[str, Any]] = None) -> TrainingFinished:
    """``training_finished``: ``params_sha256`` of ``model`` when there is one; ``extra``: the script's own."""
    return TrainingFinished(steps_completed=steps_completed, final_loss=final_loss,
                            params_sha256=params_sha256(model) if model is not None else None,
                            world_size=ctx.job_world_size, progress=progress, extra=dict(extra or {}))


def worker_failed(ctx: DistContext, exc_type: type, exc: BaseException, tb: Any) -> WorkerFailed:
    """``worker_failed`` naming this rank (the launcher names the earliest failing rank as the root cause)."""
    return WorkerFailed(rank=ctx.rank, node=ctx.node, restart_count=ctx.restart_count,
                        error=f"{exc_type.__name__}: {exc}",
                        traceback="".join(traceback.format_exception(exc_type, exc, tb))[-4000:])
