"""Fault-tolerance modes (``fault_tolerance.mode``): ``restart`` and ``per_step``, each behind one protocol on
either side. The driver's side (:mod:`~orchestrator.ft.driver`: each agent's rendezvous, the services the driver
hosts, a departed agent taken out at once) and the worker's (:mod:`~orchestrator.ft.steps`, picked by
:mod:`~orchestrator.ft.worker`: the step protocol the session calls whatever the mode).

``per_step`` is torchft's: each node is a replica group with its own torchrun rendezvous; orch's quorum service
in the driver (:mod:`~orchestrator.ft.quorum`, torchft's Lighthouse rules behind the run's gate) forms a quorum
of the live groups at every step; every worker runs a torchft Manager (:mod:`~orchestrator.ft.replica`, on
orch's quorum client: :mod:`~orchestrator.ft.coordination`) that all-reduces gradients across the quorum,
commits a step only when every participant finished it, and heals a new or returning group from a live peer
over orch's authenticated, pickle-free transport (:mod:`~orchestrator.ft.transport`,
:mod:`orchestrator.checkpoint.wire`).
"""

from __future__ import annotations

from orchestrator.config.extras import TORCHFT_REQUIREMENT, torchft_problem  # noqa: F401 (where ft's users look)
from orchestrator.trust.secret import RUN_SECRET_ENV

QUORUM_ENV = "ORCH_FT_QUORUM"  # host:port of the run's gate, where the quorum service is (the plan sets it)
SECRET_ENV = RUN_SECRET_ENV  # a peer serves its state only to a caller that presents the run's secret
ADDR_ENV = "ORCH_FT_ADDR"  # the address this node's peer state server binds and advertises
REPLICA_ENV = "ORCH_FT_REPLICA"  # this agent's replica id (node and agent incarnation)
