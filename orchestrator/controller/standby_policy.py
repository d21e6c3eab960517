"""Standby policy: which nodes get their replacement booted before they leave. Decides; starts nothing.

A preemption notice gives a node a grace period (about 2 minutes on AWS, 30 s on GCP and Azure) before its
machine goes. Booting the replacement at once, while the noticed node saves and leaves, overlaps the
replacement's start-up (process, imports, model build) with the grace period: it joins the next rendezvous
round as soon as there is room, as spot capacity requested early would. A notice delivered as a SIGTERM is
not a reason: orch forwards SIGTERM to every node when the whole launch is being stopped.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Optional

from orchestrator.controller.api import ClusterNode
from orchestrator.controller.worker_view import Notice


def standbys_to_boot(notices: Iterable[Notice], agent_started_t: dict[int, float],
                     have_standby: set[int]) -> list[int]:
    """Nodes to boot a standby for: noticed (by a source other than SIGTERM) after their current agent started,
    and without a standby yet. ``agent_started_t``: node -> when its current agent was requested."""
    boot = []
    for notice in notices:
        node = notice.node
        if (notice.source != "sigterm" and node in agent_started_t and node not in have_standby
                and node not in boot and notice.t >= agent_started_t[node]):
            boot.append(node)
    return boot


def standby_machine(node: int, current: str, machines: list[ClusterNode], used: Counter,
                    may_run: Callable[[str], bool]) -> Optional[ClusterNode]:
    """Where ``node``'s standby boots: a machine with a free slot (``used``: agents per machine) where the node
    may run (``may_run(ip)``: a node pinned to a host runs there only), the least used first, then another
    machine than the node's current one (``current``); None when none has room."""
    room = [m for m in machines if m.slots > used[m.node_id] and may_run(m.ip)]
    return min(room, key=lambda m: (used[m.node_id], m.node_id != current, m.node_id), default=None)
