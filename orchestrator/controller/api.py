"""What the controller knows about nodes and node agents, apart from how agents run (Ray actors or a fake).

The controller acts only through a :class:`NodePool`; ``ray_pool.RayNodePool`` is the real one, and tests
can swap in any object with the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Union


@dataclass(frozen=True)
class ClusterNode:
    """A machine node agents can be placed on, and how many of them fit there (placement already applied)."""

    node_id: str
    ip: str
    slots: int


@dataclass(frozen=True)
class AgentSpec:
    """One node agent to start: the node index it plays, its torchrun command line, environment and log file."""

    node: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    log_path: str = ""
    cwd: str = ""


@dataclass(frozen=True)
class AgentStarted:
    """A node agent's torchrun process is running: on which machine, under which PID."""

    node: int
    node_id: str
    ip: str
    pid: int


@dataclass(frozen=True)
class AgentExit:
    """How a node agent ended: torchrun's exit code, or ``actor_died`` when the agent itself is gone (its node
    left the cluster). ``death_signal`` is set when torchrun logged being told to stop by a signal."""

    node: int
    exit_code: Optional[int] = None
    actor_died: bool = False
    death_signal: Optional[str] = None
    detail: str = ""


AgentUpdate = Union[AgentStarted, AgentExit]


class NodePool(Protocol):
    """Where node agents run. Every method returns at once; outcomes arrive through :meth:`poll`."""

    def nodes(self) -> list[ClusterNode]:
        """Live nodes with at least one slot for a node agent."""

    def start(self, spec: AgentSpec, node_id: str) -> None:
        """Start ``spec`` on ``node_id``; an ``AgentStarted`` (or an ``AgentExit``) follows."""

    def poll(self, timeout_s: float) -> list[AgentUpdate]:
        """Agents that started or ended since the last call, waiting up to ``timeout_s`` for the first."""

    def stop(self, node: int, grace_s: float, agent_only: bool = False) -> None:
        """Stop node ``node``'s torchrun tree (SIGTERM, SIGKILL after ``grace_s``). ``agent_only`` signals
        torchrun alone, which forwards SIGTERM to its workers (a preemption notice); an ``AgentExit`` follows."""

    def close(self) -> None:
        """Stop every agent and release the pool's resources."""
