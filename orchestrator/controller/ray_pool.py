"""The NodePool on Ray: one NodeAgent actor per node index, pinned to its Ray node with a hard
NodeAffinitySchedulingStrategy and reserving ``cluster.cpus_per_node`` CPUs and ``gpus_per_agent`` GPUs there.

Slots per Ray node come from its total resources; ``spread`` caps them at one, so no two agents share a node.
An actor whose node leaves the cluster dies with it: its pending ``wait_exit`` call fails, which is how a lost
node is seen (within milliseconds of Ray noticing).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.controller.api import AgentExit, AgentSpec, AgentStarted, AgentUpdate, ClusterNode
from orchestrator.controller.node_agent import NodeAgent


class RayNodePool:
    """Node agents as Ray actors. ``spread``: at most one agent per Ray node."""

    def __init__(self, cpus_per_agent: float, gpus_per_agent: int, spread: bool, max_agents: int):
        self.cpus, self.gpus, self.spread, self.max_agents = cpus_per_agent, gpus_per_agent, spread, max_agents
        self._actor_class = ray.remote(NodeAgent)
        self._actors: dict[int, tuple[Any, str]] = {}  # node index -> (actor, Ray node id)
        self._running: set[int] = set()  # node indexes whose torchrun has started
        self._pending: dict[Any, tuple[str, int, Any]] = {}  # object ref -> ("start" | "exit", node index, actor)

    def nodes(self) -> list[ClusterNode]:
        found = []
        for node in ray.nodes():
            slots = self._slots(node.get("Resources", {})) if node.get("Alive") else 0
            if slots > 0:
                found.append(ClusterNode(node["NodeID"], node.get("NodeManagerAddress", ""), slots))
        return found

    def _slots(self, resources: dict[str, float]) -> int:
        fits = [self.max_agents]
        if self.cpus > 0:
            fits.append(int(resources.get("CPU", 0) / self.cpus + 1e-9))
        if self.gpus > 0:
            fits.append(int(resources.get("GPU", 0) / self.gpus + 1e-9))
        return min(min(fits), 1) if self.spread else min(fits)

    def start(self, spec: AgentSpec, node_id: str) -> None:
        actor = self._actor_on(spec.node, node_id)
        self._pending[actor.start.remote(spec)] = ("start", spec.node, actor)

    def _actor_on(self, node: int, node_id: str) -> Any:
        """The node's actor when it is already on ``node_id`` (its torchrun has exited), else a new one there."""
        current = self._actors.get(node)
        if current and current[1] == node_id:
            return current[0]
        if current:
            ray.kill(current[0], no_restart=True)
        actor = self._actor_class.options(
            num_cpus=self.cpus, num_gpus=self.gpus, max_concurrency=4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        self._actors[node] = (actor, node_id)
        return actor

    def poll(self, timeout_s: float) -> list[AgentUpdate]:
        refs = list(self._pending)
        if not refs:
            time.sleep(timeout_s)
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [self._resolve(ref) for ref in ready]

    def _resolve(self, ref: Any) -> AgentUpdate:
        kind, node, actor = self._pending.pop(ref)
        try:
            value = ray.get(ref)
        except RayActorError as exc:
            self._forget(node, actor)
            return AgentExit(node, actor_died=True, detail=_first_line(exc))
        except RayError as exc:  # start() raised: torchrun could not be started on that node
            self._running.discard(node)
            return AgentExit(node, detail=_first_line(exc))
        if kind == "start":
            self._running.add(node)
            self._pending[actor.wait_exit.remote()] = ("exit", node, actor)
            return AgentStarted(node, value["node_id"], value["ip"], value["pid"])
        self._running.discard(node)
        return AgentExit(node, exit_code=value["exit_code"], death_signal=value["death_signal"])

    def stop(self, node: int, grace_s: float, agent_only: bool = False) -> None:
        current = self._actors.get(node)
        if current is None:
            return
        if node in self._running:
            current[0].stop.remote(grace_s, agent_only)
        else:  # still being placed or starting: the pending start call fails, reported as the agent's exit
            ray.kill(current[0], no_restart=True)
            self._forget(node, current[0])

    def _forget(self, node: int, actor: Any) -> None:
        if node in self._actors and self._actors[node][0] is actor:
            del self._actors[node]
            self._running.discard(node)

    def close(self) -> None:
        """Kill every actor; a torchrun still running under one gets SIGTERM from its death (see node_agent)."""
        for actor, _ in self._actors.values():
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._running.clear()
        self._pending.clear()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
