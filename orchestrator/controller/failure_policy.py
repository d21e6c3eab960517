"""Failure policy: what an agent's exit means, and what the run does about it. Decides; starts nothing.

A lost or preempted node is not a failure: it spends ``failure.max_preemptions`` (unlimited by default) and
the survivors go on without it. A failure (user code, or torchrun giving up after ``cluster.max_restarts``)
spends ``failure.max_failures``: the controller restarts every node, and one failure too many ends the run,
so a deterministic bug never loops forever.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from orchestrator.config.schema import FailureConfig
from orchestrator.controller.api import AgentExit

FINISHED, STOPPED, PREEMPTED, LOST, FAILED = "finished", "stopped", "preempted", "lost", "failed"
CONTINUE, RESTART, FAIL = "continue", "restart", "fail"


@dataclass(frozen=True)
class ExitVerdict:
    """What an agent exit was (one of the kinds above) and why, in words for the event log."""

    kind: str
    reason: str


@dataclass(frozen=True)
class FailureDecision:
    """``continue`` (the job goes on), ``restart`` (every node, fresh rendezvous) or ``fail`` the run."""

    action: str
    reason: str


def classify(exit: AgentExit, stopping: bool, noticed: bool) -> ExitVerdict:
    """``stopping``: the controller asked this agent to stop; ``noticed``: its node got a preemption notice."""
    where = f"agent on node {exit.node}"
    if exit.exit_code == 0:
        return ExitVerdict(FINISHED, f"{where} finished")
    if stopping:
        return ExitVerdict(STOPPED, f"{where} stopped by the controller")
    if exit.actor_died:  # even after a notice: the machine is gone, whatever its workers were doing
        return ExitVerdict(LOST, f"{where} is gone: its Ray node left the cluster or its actor died ({exit.detail})")
    if noticed:
        return ExitVerdict(PREEMPTED, f"{where} left after a preemption notice")
    if exit.exit_code is not None and exit.exit_code < 0:
        return ExitVerdict(LOST, f"{where} killed by {signal.Signals(-exit.exit_code).name}")
    if exit.death_signal:
        return ExitVerdict(LOST, f"{where} terminated by {exit.death_signal}")
    return ExitVerdict(FAILED, f"{where} exited with code {exit.exit_code} (see logs/node{exit.node}.log)")


def decide(verdict: ExitVerdict, cfg: FailureConfig, failures: int, preemptions: int) -> FailureDecision:
    """``failures`` / ``preemptions``: how many the run has had, this exit included."""
    if verdict.kind in (LOST, PREEMPTED):
        if 0 <= cfg.max_preemptions < preemptions:
            return FailureDecision(FAIL, f"{preemptions} nodes lost or preempted, more than failure.max_preemptions="
                                         f"{cfg.max_preemptions}. Fix: raise failure.max_preemptions (-1: no limit)")
        return FailureDecision(CONTINUE, verdict.reason)
    if verdict.kind == FAILED:
        if failures > cfg.max_failures:
            return FailureDecision(FAIL, f"node agents failed {failures} time(s), more than failure.max_failures="
                                         f"{cfg.max_failures} allows ({verdict.reason})")
        return FailureDecision(RESTART, f"{verdict.reason}; restarting every node "
                                        f"(failure {failures} of failure.max_failures={cfg.max_failures})")
    return FailureDecision(CONTINUE, verdict.reason)
