"""The driver's side of a fault-tolerance mode: what the plan, the controller and the launch runner ask of it,
without knowing which mode they got (the worker's side is :mod:`orchestrator.ft.steps`).

A mode says how many nodes one rendezvous holds and which rendezvous each agent it starts joins
(:meth:`DriverMode.agent_rendezvous`), what environment and settings the plan shows for it, which services the
driver hosts behind the run's gate (:meth:`DriverMode.host`), and what happens when an agent is gone
(:meth:`DriverMode.agent_gone`: restart mode takes it out of the rendezvous round at once, per_step out of the
quorum). :func:`driver_mode` resolves ``fault_tolerance.mode`` by name.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional, Protocol

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError, RunFailed
from orchestrator.events import ReplicaDropped, RendezvousEvicted, RendezvousReopened
from orchestrator.ft import ADDR_ENV, QUORUM_ENV, REPLICA_ENV
from orchestrator.rendezvous.args import AgentRendezvous
from orchestrator.rundir import EventLog
from orchestrator.trust.secret import RUN_SECRET_ENV


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
    quorum service forms a quorum of the live groups at every step (:mod:`orchestrator.ft.quorum`). The driver
    hosts it behind the run's gate, unless ``fault_tolerance.quorum_endpoint`` names one elsewhere (a Kubernetes
    job's ``orch quorum-service``): then the agents dial that, and a departed agent is dropped there
    (:class:`RemoteQuorum`)."""

    name = "per_step"

    def __init__(self, cfg: OrchConfig):
        super().__init__(cfg)
        self.quorum: Any = None
        self.remote: Optional[RemoteQuorum] = None

    def nnodes(self) -> str:
        return "1"

    def plan_env(self, gate: str, node_address: str) -> dict[str, str]:
        return {QUORUM_ENV: self.cfg.fault_tolerance.quorum_endpoint or gate, ADDR_ENV: node_address}

    def plan_settings(self) -> dict[str, Any]:
        ft = self.cfg.fault_tolerance
        return {"mode": self.name, "heartbeat_timeout_ms": ft.heartbeat_timeout_ms,
                "collective_timeout_s": ft.collective_timeout_s,
                **({"quorum_endpoint": ft.quorum_endpoint} if ft.quorum_endpoint else {})}

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
        endpoint = self.cfg.fault_tolerance.quorum_endpoint
        if endpoint:
            self.remote = RemoteQuorum(endpoint, events, self.cfg.rendezvous.join_timeout_s)
            return
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
        if self.remote is not None:
            self.remote.drop(self.replica_id(node, agent_id))

    def close(self) -> None:
        if self.quorum is not None:
            self.quorum.close()
        if self.remote is not None:
            self.remote.close()


class RemoteQuorum:
    """The quorum service of another process (``orch quorum-service``, in a pod of its own), as a pod's driver
    sees it: reachable through its gate with the run's secret (waited for up to ``wait_s`` when the launch
    starts, since the pods of a job start in no particular order), and told at once of an agent of this pod
    that exited (``drop``; ``replica_dropped`` events in this pod's run dir). A pod that is killed whole tells
    nobody: the service sees its group's heartbeat connection close, or, with its node gone, its heartbeats age
    out (``fault_tolerance.heartbeat_timeout_ms``)."""

    def __init__(self, endpoint: str, events: EventLog, wait_s: float):
        from orchestrator.ft.coordination import QuorumClient

        self.endpoint, self.events = endpoint, events
        if not os.environ.get(RUN_SECRET_ENV):
            raise ConfigError("fault_tolerance.quorum_endpoint", endpoint, "give the launch the run's secret in "
                              f"{RUN_SECRET_ENV} (orch k8s render does, from the run's Secret: k8s.run_secret)",
                              f"is an orch quorum-service, which admits only holders of the run's secret, but "
                              f"{RUN_SECRET_ENV} is not set")
        self.client = QuorumClient(endpoint, connect_timeout_s=10.0)
        self._wait(wait_s)

    def _wait(self, wait_s: float) -> None:
        from orchestrator.trust.handshake import HandshakeError

        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.client.call("ping", timeout_s=10.0)
                return
            except OSError as exc:
                if isinstance(exc, HandshakeError) and _refused_for_good(exc):  # a retry cannot help
                    raise ConfigError("fault_tolerance.quorum_endpoint", self.endpoint, "give the quorum service "
                                      "and every node the same run's secret (one Secret: k8s.run_secret)",
                                      f"did not admit this launch ({exc})") from None
                if time.monotonic() >= deadline:  # not up yet, or cut off mid-handshake (a full gate)
                    raise RunFailed(f"the quorum service at {self.endpoint} did not answer within {wait_s:.0f} s "
                                    f"(rendezvous.join_timeout_s): {exc}") from None
                time.sleep(0.5)

    def drop(self, prefix: str) -> None:
        """Take the groups of ``prefix`` (an agent's replica id) out of the quorum, in the background: the
        controller that calls this never waits on the network."""
        threading.Thread(target=self._drop, args=(prefix,), daemon=True, name="orch-quorum-drop").start()

    def _drop(self, prefix: str) -> None:
        from orchestrator.ft.coordination import QuorumError

        try:
            dropped = self.client.call("drop", timeout_s=5.0, replica_id=prefix)["dropped"]
        except (OSError, QuorumError, KeyError):
            return  # its heartbeats age out instead
        for rid in dropped:
            self.events.write(ReplicaDropped(replica_id=rid, cause="agent_exited"))

    def close(self) -> None:
        self.client.close()


def _refused_for_good(exc: Exception) -> bool:
    """A handshake that failed because the other side is not orch's gate or holds another secret (a retry cannot
    help), not because the connection was cut (see orchestrator/trust/handshake.py's messages)."""
    return "could not prove" in str(exc) or "not an orch gate" in str(exc)


MODES = {RestartMode.name: RestartMode, PerStepMode.name: PerStepMode}


def driver_mode(cfg: OrchConfig) -> DriverMode:
    """The driver's side of ``fault_tolerance.mode``."""
    return MODES[cfg.fault_tolerance.mode](cfg)
