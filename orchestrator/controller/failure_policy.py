"""Failure policy: what an agent's exit means, and what the run does about it. Decides; starts nothing.

A lost or preempted node is not a failure: it spends ``failure.max_preemptions`` (unlimited by default) and
the survivors go on without it. A failure (user code, or torchrun giving up after ``cluster.max_restarts``)
spends ``failure.max_failures``: the controller restarts every node, and one failure too many ends the run.
A failure that repeats itself exactly (the same error on two attempts in a row) ends the run at once: a
deterministic bug is not cured by a restart, and spending the whole budget on it only delays the verdict.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

from orchestrator.config.schema import FailureConfig
from orchestrator.controller.api import AgentExit, ExitKind


class FailureAction(StrEnum):
    CONTINUE = "continue"  # the job goes on (with the survivors)
    RESTART = "restart"  # stop every node and start again with a fresh rendezvous
    FAIL = "fail"  # end the run


@dataclass(frozen=True)
class ExitVerdict:
    """What an agent exit was and why, in words for the event log."""

    kind: ExitKind
    reason: str


@dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    reason: str


def classify(exit: AgentExit, stopping: bool, noticed: bool, training_finished: bool = False,
             explained: Optional[str] = None) -> ExitVerdict:
    """``stopping``: the controller asked this agent to stop; ``noticed``: its node got a preemption notice
    while this agent ran; ``explained``: the launch's surroundings account for the exit (a partition)."""
    where = f"agent on node {exit.node}"
    if exit.actor_died:  # even after a notice: the machine is gone, whatever its workers were doing
        return ExitVerdict(ExitKind.LOST, f"{where} is gone: its Ray node left the cluster or its actor died "
                                          f"({exit.detail})")
    if noticed and not training_finished:
        # A noticed agent may exit 0 (torchrun's SIGTERM path): the notice, not the code, says why it left.
        return ExitVerdict(ExitKind.PREEMPTED, f"{where} left after a preemption notice")
    if exit.exit_code == 0:
        return ExitVerdict(ExitKind.FINISHED, f"{where} finished")
    if stopping:
        return ExitVerdict(ExitKind.STOPPED, f"{where} stopped by the controller")
    if exit.exit_code is not None and exit.exit_code < 0:
        return ExitVerdict(ExitKind.LOST, f"{where} killed by {signal.Signals(-exit.exit_code).name}")
    if exit.death_signal:
        return ExitVerdict(ExitKind.LOST, f"{where} terminated by {exit.death_signal}")
    if explained:
        return ExitVerdict(ExitKind.LOST, f"{where} {explained}")
    if exit.exit_code is None:
        return ExitVerdict(ExitKind.FAILED, f"{where} could not start ({exit.detail})")
    return ExitVerdict(ExitKind.FAILED, f"{where} exited with code {exit.exit_code} (see logs/node{exit.node}.log)")


def decide(verdict: ExitVerdict, cfg: FailureConfig, failures: int, preemptions: int,
           repeated: Optional[str] = None) -> FailureDecision:
    """``failures`` / ``preemptions``: how many the run has had, this exit included. ``repeated``: the failure
    this attempt's shares with the previous attempt's (see :func:`failure_signature`), if any."""
    if verdict.kind in (ExitKind.LOST, ExitKind.PREEMPTED):
        if 0 <= cfg.max_preemptions < preemptions:
            return FailureDecision(FailureAction.FAIL, f"{preemptions} nodes lost or preempted, more than "
                                   f"failure.max_preemptions={cfg.max_preemptions}. Fix: raise failure.max_preemptions "
                                   "(-1: no limit)")
        return FailureDecision(FailureAction.CONTINUE, verdict.reason)
    if verdict.kind == ExitKind.FAILED:
        if failures > cfg.max_failures:
            return FailureDecision(FailureAction.FAIL, f"node agents failed {failures} time(s), more than "
                                   f"failure.max_failures={cfg.max_failures} allows ({verdict.reason})")
        if repeated:
            return FailureDecision(FailureAction.FAIL, f"the same failure on two attempts in a row, a restart will not "
                                   f"cure it: {repeated}. Fix: the error in the code or data, then launch again")
        return FailureDecision(FailureAction.RESTART, f"{verdict.reason}; restarting every node "
                                                      f"(failure {failures} of failure.max_failures={cfg.max_failures})")
    return FailureDecision(FailureAction.CONTINUE, verdict.reason)


# The last line of a Python traceback as torchrun's --tee prints it: "[node0-local1]:ValueError: boom".
_EXCEPTION_LINE = re.compile(r"^(?:\[[^\]]+\]:)?\s*((?:[A-Za-z_][\w.]*)(?:Error|Exception|Interrupt|Exit)\b.*)$")
_ADDRESSES = re.compile(r"0x[0-9a-f]+|\b\d{4,}\b")  # pids, ports, object ids: they differ between attempts


def failure_signature(worker_failures: list[dict[str, Any]], log_path: Path, log_offset: int) -> Optional[str]:
    """What failed, comparable between attempts: the earliest ``worker_failed`` error of the attempt (orch's
    runtime records one per failing rank), else the last exception line the node's log got since the agent
    started (any script: torchrun's --tee copies the workers' tracebacks there). None if nothing says."""
    if worker_failures:
        first = min(worker_failures, key=lambda e: e["t"])
        return f"rank {first.get('rank')}: {first.get('error')}"
    try:
        with log_path.open("rb") as f:
            f.seek(log_offset)
            text = f.read()[-65536:].decode(errors="replace")
    except OSError:
        return None
    lines = [m.group(1).strip() for m in map(_EXCEPTION_LINE.match, text.splitlines()) if m]
    errors = [line for line in lines if not line.startswith(("torch.distributed.elastic", "ChildFailedError"))]
    return errors[-1] if errors else None


def same_failure(a: Optional[str], b: Optional[str]) -> bool:
    """Two signatures name the same failure (numbers that change from run to run, like PIDs, aside)."""
    return a is not None and b is not None and _ADDRESSES.sub("#", a) == _ADDRESSES.sub("#", b)


class FailureBudget:
    """The run's failures and preemptions so far, and the decision on one more exit (:func:`decide`, after
    :func:`failure_signature` tells whether a failure repeats the previous attempt's)."""

    def __init__(self, cfg: FailureConfig):
        self.cfg = cfg
        self.failures = self.preemptions = 0
        self._previous: Optional[str] = None

    def charge(self, verdict: ExitVerdict, worker_failures: list[dict[str, Any]], log_path: Path,
               log_offset: int) -> tuple[FailureDecision, Optional[str]]:
        """Count an exit (``worker_failures``: this attempt's ``worker_failed`` records; the node's log from
        ``log_offset``); returns the decision and the repeated failure, if it is one."""
        repeated = None
        if verdict.kind in (ExitKind.LOST, ExitKind.PREEMPTED):
            self.preemptions += 1
        elif verdict.kind == ExitKind.FAILED:
            self.failures += 1
            signature = failure_signature(worker_failures, log_path, log_offset)
            repeated = signature if same_failure(signature, self._previous) else None
            self._previous = signature
        return decide(verdict, self.cfg, self.failures, self.preemptions, repeated), repeated
