"""Standby policy: which nodes get their replacement booted before they leave. Decides; starts nothing.

A preemption notice gives a node a grace period (about 2 minutes on AWS, 30 s on GCP and Azure) before its
machine goes. Booting the replacement at once, while the noticed node saves and leaves, overlaps the
replacement's start-up (process, imports, model build) with the grace period: it joins the next rendezvous
round as soon as there is room, as spot capacity requested early would. A notice delivered as a SIGTERM is
not a reason: orch forwards SIGTERM to every node when the whole launch is being stopped.
"""

from __future__ import annotations

from typing import Any, Iterable


def standbys_to_boot(notices: Iterable[dict[str, Any]], agent_started_t: dict[int, float],
                     have_standby: set[int]) -> list[int]:
    """Nodes to boot a standby for: noticed (by a source other than SIGTERM) after their current agent started,
    and without a standby yet. ``agent_started_t``: node -> when its current agent was requested."""
    boot = []
    for notice in notices:
        node = notice.get("node")
        if (notice.get("source") != "sigterm" and node in agent_started_t and node not in have_standby
                and node not in boot and notice["t"] >= agent_started_t[node]):
            boot.append(node)
    return boot
