"""Scaling policy: where new node agents go, and when too few nodes end the run. Decides; starts nothing.

Agents go on free slots up to MAX nodes, spread over as many machines as possible. Below MIN for longer than
``failure.wait_for_nodes_s`` the run fails with a message saying so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from orchestrator.controller.api import ClusterNode


@dataclass(frozen=True)
class ScalingDecision:
    """Start one agent on each node id in ``start_on`` (a node id may repeat when agents pack); or fail."""

    start_on: tuple[str, ...] = ()
    fail_reason: Optional[str] = None


@dataclass(frozen=True)
class ScalingPolicy:
    min_nodes: int
    max_nodes: int
    wait_for_nodes_s: float

    def decide(self, nodes: list[ClusterNode], agents_on: Counter, grow: bool, below_min_for_s: float,
               standbys_on: Counter = Counter()) -> ScalingDecision:
        """``agents_on``: node id -> agents there (running or starting). ``grow``: may go past MIN (the
        controller holds growth back while survivors recover). ``below_min_for_s``: how long the run has had
        fewer than MIN agents (0 when it has enough). ``standbys_on``: slots taken by standbys, which count
        against a machine's slots but not toward the job's size."""
        have = sum(agents_on.values())
        target = self.max_nodes if grow or have < self.min_nodes else have
        used = agents_on + standbys_on
        free = Counter({n.node_id: n.slots - used[n.node_id] for n in nodes if n.slots > used[n.node_id]})
        start: list[str] = []
        while have + len(start) < target and free:
            # Round-robin over machines, fewest of our agents first: spread before packing.
            node_id = min(free, key=lambda n: (used[n] + start.count(n), n))
            start.append(node_id)
            free[node_id] -= 1
            if free[node_id] == 0:
                del free[node_id]
        if have + len(start) < self.min_nodes and below_min_for_s > self.wait_for_nodes_s:
            return ScalingDecision(fail_reason=(
                f"only {have + len(start)} of MIN={self.min_nodes} nodes for {below_min_for_s:.0f} s, longer than "
                f"failure.wait_for_nodes_s={self.wait_for_nodes_s:g} (the cluster offers {len(nodes)} usable node(s), "
                f"{sum(n.slots for n in nodes)} agent slot(s)). Fix: add Ray nodes, lower MIN in cluster.nnodes, "
                "or raise failure.wait_for_nodes_s"))
        return ScalingDecision(start_on=tuple(start))
