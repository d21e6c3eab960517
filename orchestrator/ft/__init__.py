"""Per-step fault tolerance (``fault_tolerance.mode=per_step``) on torchft.

Each node is a replica group with its own torchrun rendezvous; orch's quorum service in the driver
(:mod:`~orchestrator.ft.quorum`, torchft's Lighthouse rules behind the run's gate) forms a quorum of the live
groups at every step; every worker runs a torchft Manager (:mod:`~orchestrator.ft.replica`, on orch's quorum
client: :mod:`~orchestrator.ft.coordination`) that all-reduces gradients across the quorum, commits a step
only when every participant finished it, and heals a new or returning group from a live peer over orch's
authenticated, pickle-free transport (:mod:`~orchestrator.ft.transport`, :mod:`~orchestrator.ft.wire`).
"""

from __future__ import annotations

import os
from typing import Optional

from orchestrator.trust.secret import RUN_SECRET_ENV

QUORUM_ENV = "ORCH_FT_QUORUM"  # host:port of the run's gate, where the quorum service is (the plan sets it)
SECRET_ENV = RUN_SECRET_ENV  # a peer serves its state only to a caller that presents the run's secret
ADDR_ENV = "ORCH_FT_ADDR"  # the address this node's peer state server binds and advertises
REPLICA_ENV = "ORCH_FT_REPLICA"  # this agent's replica id (node and agent incarnation)

TORCHFT_REQUIREMENT = "torchft-nightly==2026.10.26"


def torchft_problem() -> Optional[str]:
    """Why torchft cannot be used here, or None."""
    # torchft's Rust side logs every quorum and commit at INFO, and reads RUST_LOG when first imported.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft.manager  # noqa: F401
    except ImportError as exc:
        return f"needs torchft ({TORCHFT_REQUIREMENT}), which is not importable here ({exc})"
    return None
