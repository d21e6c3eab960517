"""``launcher=local``: every node of the plan as a torchrun agent process on this machine, run by the one
controller (orchestrator/controller/) through a local node pool. No Ray.

The launch hosts the rendezvous store itself (agents use ``is_host=false``), so killing any simulated node
never takes rendezvous down; with an elastic ``cluster.nnodes=MIN:MAX`` the survivors re-rendezvous and go on,
and a lost or preempted node's slot is filled again. Inside a Kubernetes pod (``cluster.node_index``) it runs
the one node of that pod against the job's store (``rendezvous.external``: ``orch rendezvous-store`` behind a
Service), hosting none itself; under per_step its agents dial the job's quorum service
(``fault_tolerance.quorum_endpoint``: ``orch quorum-service`` behind its own Service). On a test cluster (``cluster.testcluster``) each node's agent runs on its own
host (``launchers/testcluster.py``).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional, TextIO

from launchers.runner import SiteBase
from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import NodePool, RunHooks
from orchestrator.controller.pools.local import LocalNodePool
from orchestrator.processes import WarmInterpreter, close_warm, take_ahead
from orchestrator.rendezvous.args import AGENT_MODULE, WARM_MODULE
from orchestrator.rundir import EventLog

LOCAL_ADDR_ENV = "PET_LOCAL_ADDR"  # torchrun's --local-addr; orch's manifests set it to the pod IP


class LocalSite(SiteBase):
    """Every node on this machine, as a process of this launch."""

    name = "local"
    warm: list[WarmInterpreter]

    def store_host(self) -> Optional[str]:
        return None if self.cfg.rendezvous.external else self.cfg.rendezvous.host

    def connect(self) -> None:
        # Each node's agent interpreter imports torch's elastic agent while the driver hosts the store, writes the
        # run dir and plans: the one ``orch launch`` started at its first moment (see lifecycle/cli.py), and one
        # started now for every other node.
        ahead = take_ahead(AGENT_MODULE)
        self.warm = ahead[:len(self.node_indexes)]
        close_warm(ahead[len(self.node_indexes):])
        self.warm += [WarmInterpreter(WARM_MODULE, AGENT_MODULE) for _ in self.node_indexes[len(self.warm):]]

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        # Room for every node and, on a notice, its standby: simulated nodes share this machine.
        return LocalNodePool(slots=2 * len(self.node_indexes), echo=self.echo, warm=self.warm), RunHooks()

    def close(self, pool: Optional[NodePool], hooks: Optional[RunHooks]) -> None:
        close_warm(getattr(self, "warm", []))  # the launch ended before its pool took them
        super().close(pool, hooks)


class PodHooks(RunHooks):
    """A pod plays one node of a job: the run's records (rank 0's) may be written in another pod's run dir."""

    records_training = False


class PodSite(LocalSite):
    """One node of a multi-pod job (a Kubernetes pod): ``cluster.node_index``, against the job's store. The
    node's own address (where per_step's peers fetch its state) is the pod's: see :func:`pod_address`."""

    def __init__(self, cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None):
        super().__init__(cfg, run_id, echo)
        self.node_indexes = [cfg.cluster.node_index]
        self.nodes_here = 1
        self.node_address = pod_address(cfg.rendezvous.host, cfg.rendezvous.port)

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        pool, _ = super().start(events, store, since)
        return pool, PodHooks()


def pod_address(store_host: str, store_port: int) -> Optional[str]:
    """This pod's address, which other pods dial: torchrun's ``--local-addr`` (``PET_LOCAL_ADDR``), which orch's
    manifests set to the pod IP (the downward API's ``status.podIP``); without it (one node per machine, by hand),
    the address of the interface that routes to the job's store (a UDP socket's connect sends nothing); None
    when neither is known (the plan then uses ``rendezvous.host``)."""
    given = os.environ.get(LOCAL_ADDR_ENV)
    if given:
        return given
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((store_host, store_port or 1))
            return probe.getsockname()[0]
    except OSError:
        return None


def make_site(cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None) -> SiteBase:
    """``launcher=local``'s site: a test cluster's hosts, a pod's node, or every node here."""
    if cfg.cluster.testcluster:
        from launchers.testcluster import LocalTestClusterSite

        return LocalTestClusterSite(cfg, run_id, echo)
    if cfg.cluster.node_index is not None:
        return PodSite(cfg, run_id, echo)
    return LocalSite(cfg, run_id, echo)
