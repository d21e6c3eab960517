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
from orchestrator.controller.pools.node_agent import NodeAgent


class RayNodePool:
    """Node agents as Ray actors. ``spread``: at most one agent per Ray node."""

    def __init__(self, cpus_per_agent: float, gpus_per_agent: int, spread: bool, max_agents: int):
        self.cpus, self.gpus, self.spread, self.max_agents = cpus_per_agent, gpus_per_agent, spread, max_agents
        self._actor_class = ray.remote(NodeAgent)
        self._actors: dict[int, tuple[Any, int, str]] = {}  # agent id -> (actor, node index, Ray node id)
        self._idle: dict[str, list[Any]] = {}  # Ray node id -> actors whose torchrun exited (they hold its slot)
        self._running: set[int] = set()  # agent ids whose torchrun has started
        self._pending: dict[Any, tuple[str, int, Any]] = {}  # object ref -> ("start" | "exit", agent id, actor)

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
        # An idle actor on that Ray node runs the next torchrun: no new actor to place, no slot held twice.
        idle = self._idle.get(node_id)
        actor = idle.pop() if idle else self._actor_class.options(
            num_cpus=self.cpus, num_gpus=self.gpus, max_concurrency=4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        self._actors[spec.agent_id] = (actor, spec.node, node_id)
        self._pending[actor.start.remote(spec)] = ("start", spec.agent_id, actor)

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
        kind, agent_id, actor = self._pending.pop(ref)
        node = self._actors[agent_id][1] if agent_id in self._actors else -1
        try:
            value = ray.get(ref)
        except RayActorError as exc:
            self._forget(agent_id)
            return AgentExit(agent_id, node, actor_died=True, detail=_first_line(exc))
        except RayError as exc:  # start() raised: torchrun could not be started on that node
            self._running.discard(agent_id)
            return AgentExit(agent_id, node, detail=_first_line(exc))
        if kind == "start":
            self._running.add(agent_id)
            self._pending[actor.wait_exit.remote()] = ("exit", agent_id, actor)
            return AgentStarted(agent_id, node, value["node_id"], value["ip"], value["pid"])
        self._running.discard(agent_id)
        entry = self._actors.pop(agent_id, None)
        if entry is not None:
            self._park(entry)
        return AgentExit(agent_id, node, exit_code=value["exit_code"], death_signal=value["death_signal"])

    def _park(self, entry: tuple[Any, int, str]) -> None:
        actor, _, node_id = entry
        self._idle.setdefault(node_id, []).append(actor)

    def stop(self, agent_id: int, grace_s: float, agent_only: bool = False) -> None:
        entry = self._actors.get(agent_id)
        if entry is None:
            return
        if agent_id in self._running:
            entry[0].stop.remote(grace_s, agent_only)
        else:  # still being placed or starting: the pending start call fails, reported as the agent's exit
            ray.kill(entry[0], no_restart=True)
            self._forget(agent_id)

    def _forget(self, agent_id: int) -> None:
        self._actors.pop(agent_id, None)
        self._running.discard(agent_id)

    def close(self) -> None:
        """Kill every actor; a torchrun still running under one gets SIGTERM from its death (see node_agent)."""
        for actor in [*(a for a, _, _ in self._actors.values()), *(a for idle in self._idle.values() for a in idle)]:
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._idle.clear()
        self._running.clear()
        self._pending.clear()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
