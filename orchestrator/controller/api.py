"""What the controller knows about nodes, node agents and time, apart from how agents run.

The controller acts only through a :class:`NodePool`: local processes (``pools/local.py``), Ray actors
(``pools/ray.py``) and test-cluster hosts (``launchers/testcluster.py``) are the real ones; the fast
tests swap in a scripted pool and a :class:`ManualClock`, so every controller behaviour runs in milliseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional, Protocol, Union

from orchestrator.events import Event, NodeFailed, NodeFinished, NodeLost, NodePreempted, NodeStopped

NODE_ADDRESS = "<this node's address>"
"""An env value a pool replaces with the address of the machine an agent lands on (a Ray node's IP): what the
plan gives a node whose machine is not known when planning."""


class RunStatus(StrEnum):
    """How a launch ended (``run_finished.status`` and ``summary.json``'s ``status``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # SIGINT to orch
    PREEMPTED = "preempted"  # SIGTERM to orch: every node saved and left; launch again to resume
    STOPPED = "stopped"  # `orch stop` (STOP_SIGNAL to orch): every node saved and left; `orch resume` goes on


class ExitKind(StrEnum):
    """What a node agent's exit was; each has its event (``node_<kind>``), made by :meth:`event`."""

    FINISHED = "finished"  # exit 0: its workers are done
    STOPPED = "stopped"  # the controller asked it to stop
    PREEMPTED = "preempted"  # it left after a preemption notice
    LOST = "lost"  # killed, or its machine is gone: not the job's fault
    FAILED = "failed"  # user code failed, or torchrun gave up after cluster.max_restarts

    def event(self, node: int, exit_code: Optional[int], reason: str, attempt: int) -> Event:
        """The ``node_<kind>`` event of an agent's exit of this kind."""
        cls = {ExitKind.FINISHED: NodeFinished, ExitKind.STOPPED: NodeStopped, ExitKind.PREEMPTED: NodePreempted,
               ExitKind.LOST: NodeLost, ExitKind.FAILED: NodeFailed}[self]
        return cls(node=node, exit_code=exit_code, reason=reason, attempt=attempt)


@dataclass(frozen=True)
class ClusterNode:
    """A machine node agents can be placed on, and how many of them fit there (placement already applied)."""

    node_id: str
    ip: str
    slots: int


@dataclass(frozen=True)
class AgentSpec:
    """One node agent to start: ``agent_id`` (unique within a launch: a node's standby and its current agent
    differ) plays node index ``node`` with its torchrun command line, environment and log file."""

    agent_id: int
    node: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    log_path: str = ""
    cwd: str = ""


@dataclass(frozen=True)
class AgentStarted:
    """An agent's torchrun process is running: on which machine, under which PID."""

    agent_id: int
    node: int
    node_id: str
    ip: str
    pid: int


@dataclass(frozen=True)
class AgentExit:
    """How an agent ended: torchrun's exit code, or ``actor_died`` when the agent itself is gone (its machine
    left the cluster). ``death_signal`` is set when torchrun logged being told to stop by a signal."""

    agent_id: int
    node: int
    exit_code: Optional[int] = None
    actor_died: bool = False
    death_signal: Optional[str] = None
    detail: str = ""


AgentUpdate = Union[AgentStarted, AgentExit]


class NodePool(Protocol):
    """Where node agents run. Every method returns at once; outcomes arrive through :meth:`poll`."""

    def nodes(self) -> list[ClusterNode]:
        """Live machines with at least one slot for a node agent."""

    def start(self, spec: AgentSpec, node_id: str) -> None:
        """Start ``spec`` on ``node_id``; an ``AgentStarted`` (or an ``AgentExit``) follows."""

    def poll(self, timeout_s: float) -> list[AgentUpdate]:
        """Agents that started or ended since the last call, waiting up to ``timeout_s`` for the first."""

    def stop(self, agent_id: int, grace_s: float, agent_only: bool = False) -> None:
        """Stop an agent's torchrun tree (SIGTERM, SIGKILL after ``grace_s``). ``agent_only`` signals torchrun
        alone, which forwards SIGTERM to its workers (a preemption notice); an ``AgentExit`` follows."""

    def close(self) -> None:
        """Stop every agent and release the pool's resources."""


class RunHooks:
    """What a site adds around its pool: duties on every controller tick (test clusters: fault events,
    partitioned rounds, the hosts' Ray nodes) and where nodes may run. The default does nothing and places any
    free node anywhere."""

    records_training: bool = True
    """Whether the run's records (rank 0's ``training_finished``) land in this controller's run dir: false for a
    Kubernetes pod, whose rank 0 may train in another pod."""

    def node_for(self, ip: str, free: list[int]) -> Optional[int]:
        """Which of the ``free`` nodes an agent on the machine with ``ip`` plays (None: none may run there)."""
        return free[0] if free else None

    def on_tick(self, agent_pids: dict[int, int], rdzv_id: str) -> Optional[str]:
        """``agent_pids``: node -> torchrun PID of the running agents. A returned reason fails the run at once
        (the machines themselves are gone: nothing is left to stop)."""
        return None

    def explain_exit(self, node: int, exit_code: Optional[int], started_t: float) -> Optional[str]:
        """Why ``node``'s agent left, when its surroundings explain it (a network partition): it is then a lost
        node, not a failure."""
        return None

    def close(self) -> None:
        pass


class Clock:
    """Wall time (event timestamps, compared with workers' events) and monotonic time (timeouts)."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock(Clock):
    """A clock that moves only when told to: controller tests step through minutes in microseconds."""

    def __init__(self, start: Optional[float] = None):
        self._wall = time.time() if start is None else start
        self._mono = 1000.0

    def time(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._wall += seconds
        self._mono += seconds
