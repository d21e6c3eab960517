"""The driver's side of a fault-tolerance mode: what the plan, the controller and the launch runner ask of it,
without knowing which mode they got (the worker's side is :mod:`orchestrator.ft.steps`).

A mode says how many nodes one rendezvous holds and which rendezvous each agent it starts joins
(:meth:`DriverMode.agent_rendezvous`), what environment and settings the plan shows for it, which services the
driver hosts behind the run's gate (:meth:`DriverMode.host`), and what happens when an agent is gone
(:meth:`DriverMode.agent_gone`: restart mode takes it out of the rendezvous round at once, per_step out of the
quorum). :func:`driver_mode` resolves ``fault_tolerance.mode`` by name.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from orchestrator.config.schema import OrchConfig
from orchestrator.events import ReplicaDropped, RendezvousEvicted, RendezvousReopened
from orchestrator.ft import ADDR_ENV, QUORUM_ENV, REPLICA_ENV
from orchestrator.rendezvous.args import AgentRendezvous
from orchestrator.rundir import EventLog


class DriverMode(Protocol):
    """One fault-tolerance mode as the driver runs it."""

    name: str

    def nnodes(self) -> str:
        """torchrun's ``--nnodes`` of every agent (``MIN:MAX``, or ``1`` for a group of its own)."""

    def plan_env(self, gate: str, node_address: str) -> dict[str, str]:
        """The environment the plan gives every node (``gate``: where the run's store is; the node's address)."""

    def plan_settings(self) -> dict[str, Any]:
        """What ``--dry-run`` and ``plan.json`` show of the mode."""

    def plan_notes(self) -> list[str]:
        """Warnings ``--dry-run`` prints about this mode and the cluster shape."""

    def agent_rendezvous(self, run_id: str, node: int, agent_id: int, attempt: int) -> AgentRendezvous:
        """The rendezvous agent ``agent_id`` (playing ``node``, in restart attempt ``attempt``) joins."""

    def host(self, store: Any, events: EventLog) -> None:
        """Start what the driver hosts for this mode behind the run's ``store`` (None: the store is elsewhere)."""

    def agent_gone(self, agent_id: int, node: int, pid: int, rendezvous_id: str) -> None:
        """An agent that played ``node`` exited: take it out of whatever it was a member of, now."""

    def close(self) -> None:
        """Stop what :meth:`host` started."""


def attempt_rendezvous_id(run_id: str, attempt: int) -> str:
    """The run's rendezvous id in restart attempt ``attempt``: fresh for every restart of all nodes (a failed
    agent closed the previous one)."""
    return run_id if attempt == 0 else f"{run_id}-{attempt}"


class RestartMode:
    """``restart``: one rendezvous of every node per attempt; a lost node's survivors restart their workers."""

    name = "restart"

    def __init__(self, cfg: OrchConfig):
        self.cfg = cfg
        self.store: Any = None
        self.events: Optional[EventLog] = None

    def nnodes(self) -> str:
        return f"{self.cfg.cluster.min_nodes}:{self.cfg.cluster.max_nodes}"

    def plan_env(self, gate: str, node_address: str) -> dict[str, str]:
        return {}

    def plan_settings(self) -> dict[str, Any]:
        return {"mode": self.name}

    def plan_notes(self) -> list[str]:
        return []

    def agent_rendezvous(self, run_id: str, node: int, agent_id: int, attempt: int) -> AgentRendezvous:
        return AgentRendezvous(attempt_rendezvous_id(run_id, attempt), self.nnodes())

    def host(self, store: Any, events: EventLog) -> None:
        self.store, self.events = store, events

    def agent_gone(self, agent_id: int, node: int, pid: int, rendezvous_id: str) -> None:
        """The survivors' next round need not wait for the departed agent's keep-alive to expire."""
        if self.store is None or self.events is None:
            return
        result = self.store.evict(rendezvous_id, pid)
        if result:
            self.events.write(RendezvousEvicted(node=node, agent_pid=pid))
            if result.reopened:
                self.events.write(RendezvousReopened(node=node, round=result.round,
                                                     reason="a member of a complete round left: its survivors "
                                                            "re-rendezvous now instead of waiting for it in "
                                                            "process-group init"))

    def close(self) -> None:
        pass


class PerStepMode(RestartMode):
    """``per_step``: every agent a replica group of its own (a one-node rendezvous no other agent joins); the
    quorum service in the driver forms a quorum of the live groups at every step (:mod:`orchestrator.ft.quorum`)."""

    name = "per_step"

    def __init__(self, cfg: OrchConfig):
        super().__init__(cfg)
        self.quorum: Any = None

    def nnodes(self) -> str:
        return "1"

    def plan_env(self, gate: str, node_address: str) -> dict[str, str]:
        return {QUORUM_ENV: gate, ADDR_ENV: node_address}

    def plan_settings(self) -> dict[str, Any]:
        ft = self.cfg.fault_tolerance
        return {"mode": self.name, "heartbeat_timeout_ms": ft.heartbeat_timeout_ms,
                "collective_timeout_s": ft.collective_timeout_s}

    def plan_notes(self) -> list[str]:
        c = self.cfg.cluster
        if c.min_nodes == c.max_nodes > 1:
            return [f"per_step with MIN = MAX = {c.max_nodes} nodes: the survivors of a loss keep their state but "
                    f"train only once a replacement joins (cluster.nnodes=1:{c.max_nodes} lets them go on)"]
        return []

    @staticmethod
    def replica_id(node: int, agent_id: int) -> str:
        """A group's replica id: the node and the agent's incarnation (torchft's Manager appends ``:<uuid>``)."""
        return f"node{node}-a{agent_id}"

    def agent_rendezvous(self, run_id: str, node: int, agent_id: int, attempt: int) -> AgentRendezvous:
        replica = self.replica_id(node, agent_id)
        return AgentRendezvous(f"{run_id}-{replica}", "1", {REPLICA_ENV: replica})

    def host(self, store: Any, events: EventLog) -> None:
        from orchestrator.ft.quorum import ROUTE, QuorumService

        super().host(store, events)
        if store is None:
            return
        ft = self.cfg.fault_tolerance
        self.quorum = QuorumService(self.cfg.cluster.min_nodes, ft.join_timeout_ms, ft.quorum_tick_ms,
                                    ft.heartbeat_timeout_ms,
                                    on_drop=lambda rid, cause: events.write(ReplicaDropped(replica_id=rid, cause=cause)))
        store.add_route(ROUTE, self.quorum.handler)

    def agent_gone(self, agent_id: int, node: int, pid: int, rendezvous_id: str) -> None:
        """Its group's rendezvous was its own; the quorum drops it now, not after its heartbeats age out."""
        if self.quorum is not None:
            self.quorum.drop(self.replica_id(node, agent_id))

    def close(self) -> None:
        if self.quorum is not None:
            self.quorum.close()


MODES = {RestartMode.name: RestartMode, PerStepMode.name: PerStepMode}


def driver_mode(cfg: OrchConfig) -> DriverMode:
    """The driver's side of ``fault_tolerance.mode``."""
    return MODES[cfg.fault_tolerance.mode](cfg)
