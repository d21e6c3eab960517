"""A session's answer to a preemption notice: agree, save, leave.

At every step boundary all ranks all-reduce the earliest notice time any of them holds (MIN, one float64).
If there is one, every rank joins a synchronous emergency checkpoint of the step just completed (after any
async save in flight), and exits with PREEMPTED_EXIT_CODE (75). The noticed node also stops its torchrun
agent (unless SIGTERM already is), so it leaves the job instead of being restarted on a machine about to
vanish; the other nodes' agents restart their workers, which re-rendezvous and resume from that checkpoint.

How SIGTERM is read comes from ``ORCH_SIGTERM_NOTICE`` (see orchestrator/preemption/watcher.py): under orch's
launcher only a SIGTERM that orch announced in the agent's notice file is a notice. torchrun's SIGTERM to the
workers it restarts is agreed on at the same step boundary, in the same all-reduce, and every rank then leaves
without a checkpoint as its own agent's SIGTERM arrives, so no rank breaks a collective its peers are still in.
Without a run dir (a bare torchrun, a single process) there are no notice files: every SIGTERM is a notice.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Optional

import torch

from orchestrator.checkpoint import CheckpointError
from orchestrator.config.schema import PreemptionConfig
from orchestrator.elastic import collectives
from orchestrator.elastic.checkpoints import SessionCheckpoints, WriteEvent
from orchestrator.elastic.worker_events import emergency_checkpoint
from orchestrator.events import PreemptionGraceShort, PreemptionNotice
from orchestrator.ft.steps import RestartSteps, StepProtocol
from orchestrator.preemption import (PREEMPTED_EXIT_CODE, AgentNotices, PreemptionWatcher, build_sources,
                                     sigterm_notice_mode)
from orchestrator.preemption.notices import SIGTERM_SOURCE
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Progress

# How long the ranks whose agent has not restarted them yet wait for its SIGTERM once another rank got its own:
# an agent sees a joining node on its next monitor tick (0.5 s in orch's plan), later on a busy machine.
RESTART_WAIT_S = 5.0
RUN_DIR_SOURCES = ("chaos",)  # read notice files under the run dir


class PreemptedExit(SystemExit):
    """Raised at a step boundary after the emergency checkpoint is committed: the worker exits with
    PREEMPTED_EXIT_CODE (75), which orch's launcher reads as "preempted", not "failed". Let it propagate."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


class PreemptionResponse:
    """Owns the notice watcher of one worker and the step-boundary agreement (:meth:`check`).

    ``checkpoints`` None: nothing to save, a notice only makes every rank leave with 75 at the boundary.
    ``ft``: the fault-tolerance mode's step protocol (default restart's), asked whether peers hold the state."""

    def __init__(self, cfg: PreemptionConfig, ctx: DistContext, run_dir: Optional[str], device: torch.device,
                 progress: Progress, checkpoints: Optional[SessionCheckpoints], write: WriteEvent,
                 ft: Optional[StepProtocol] = None):
        self.cfg, self.ctx, self.device, self.progress = cfg, ctx, device, progress
        self.checkpoints, self.write = checkpoints, write
        self.ft = ft if ft is not None else RestartSteps()
        sources = [s for s in cfg.sources if run_dir is not None or s not in RUN_DIR_SOURCES]
        # One poller per node is enough (local rank 0); every rank handles SIGTERM, which hits them all, and reads
        # the agent's notice file at start-up (a notice given between rounds, before this worker existed).
        pollers = build_sources(sources, cfg, run_dir, ctx.node) if ctx.local_rank == 0 else []
        mode = sigterm_notice_mode() if SIGTERM_SOURCE in sources else None
        notices = AgentNotices.of_parent(run_dir, ctx.node, set(sources)) if run_dir is not None else None
        self.watcher = PreemptionWatcher(pollers, mode, cfg.poll_interval_s, notices, defer_restart=True).start()
        self._reported = False
        # A mode that works ahead of the step boundary holds back while the boundary will act on one of these.
        self.ft.notices(lambda: self.watcher.notice is not None or self.watcher.restart_requested)

    def stop(self) -> None:
        self.watcher.stop()

    def check(self) -> None:
        """At a step boundary, on every rank: raises PreemptedExit after the emergency checkpoint if any rank
        holds a notice; leaves for a restart (os._exit) if torchrun is restarting any rank."""
        notice = self.watcher.notice
        if notice is not None and not self._reported and self.ctx.local_rank == 0:
            self._reported = True
            self.write(PreemptionNotice(node=self.ctx.node, source=notice.source, detail=notice.detail,
                                       step=self.progress.step, notice_t=notice.t))
        # One all-reduce for both questions: the earliest notice, and whether any rank is being restarted (-1).
        flags = torch.tensor([notice.t if notice else math.inf, -1.0 if self.watcher.restart_requested else 0.0],
                             dtype=torch.float64, device=self.device)
        collectives.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
        earliest, restart = flags.tolist()
        if math.isfinite(earliest):  # a notice wins: every rank is still here to save
            self.watcher.mark_acting()  # a SIGTERM from a torchrun restart no longer cuts the save short
            self._save_and_leave(earliest)
        if restart < 0:
            self._commit_save_in_flight()
            self.watcher.leave_for_restart(RESTART_WAIT_S)

    def _commit_save_in_flight(self) -> None:
        """Leaving for a restart starts no save, but lets a periodic one already being written commit (rank0:
        rank 0 writes alone, so no peer is needed; dcp: every rank waits for its part, and a commit whose peer is
        gone gives up after its group's timeout): the next round then resumes from it. os._exit would tear it."""
        if self.checkpoints is None:
            return
        try:
            self.checkpoints.wait()  # rank0: rank 0's write; dcp: every rank's part of the commit
        except CheckpointError:
            pass  # the background writer logged checkpoint_failed; the next round resumes from an older save

    def _save_and_leave(self, notice_t: float) -> None:
        step, start = self.progress.step, time.time()
        if self.ft.peers_hold_state():
            # The peers go on with the state: this node leaves at the boundary with nothing to save (a periodic
            # save it was writing as the leader is let commit first).
            self._commit_save_in_flight()
            self.ft.left(step, notice_t)
        elif self.checkpoints is not None:
            if self.ctx.is_main:
                remaining = self.cfg.grace_period_s - (start - notice_t)
                expected = self.checkpoints.expected_save_s()
                if expected is not None and expected > remaining:
                    self.write(PreemptionGraceShort(step=step, expected_save_s=expected, remaining_s=remaining,
                                                   grace_period_s=self.cfg.grace_period_s))
            self.checkpoints.save(reason="preemption", sync=True)  # committed before anyone leaves
            if self.ctx.is_main:
                self.write(emergency_checkpoint(step, time.time() - start, notice_t))
        collectives.barrier()  # nobody exits before the checkpoint is committed
        notice = self.watcher.notice
        if notice is not None and notice.source != SIGTERM_SOURCE and self.ctx.local_rank == 0 and self._under_agent():
            os.kill(os.getppid(), signal.SIGTERM)  # the torchrun agent: this node leaves the job
        raise PreemptedExit(step)

    @staticmethod
    def _under_agent() -> bool:
        """torchrun started this worker (its parent is the agent): never signal the shell of a lone process."""
        return "TORCHELASTIC_RUN_ID" in os.environ
