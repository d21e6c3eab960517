"""``cluster.testcluster=NAME``: a launch on a test cluster's hosts (network namespaces on this machine, see
orchestrator/testcluster/), under ``launcher=local`` or ``launcher=ray``. The only site that reads test-cluster
state, and it reads it once, when the site is made.

- Node i runs on host i: the plan carries each host as a neutral :class:`~orchestrator.plan.hosts.HostRecord`
  (address, hostname, its interface for gloo, the ``ip netns exec`` prefix), the store listens on the
  cluster's bridge address.
- ``TestClusterPool`` (local): agents as processes on this machine, each entered into its host's network
  namespace; every host is a machine with one slot, listed only while its link is up (a partitioned host gets
  no agent, a healed one gets one again through the controller's ordinary growth).
- ``TestClusterHooks``: node i may run only on host i; every controller tick records the cluster's faults as
  run events, breaks a round a partition left hanging, ends a healed host's stale workers, and (launcher=ray)
  keeps the hosts' Ray nodes up.
"""

from __future__ import annotations

from typing import Any, Optional, TextIO

from launchers.ray import RaySite, abandon_ray
from launchers.runner import SiteBase
from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import AgentSpec, ClusterNode, NodePool, RunHooks
from orchestrator.controller.pools.local import LocalNodePool
from orchestrator.plan.hosts import HostRecord
from orchestrator.rundir import EventLog
from orchestrator.testcluster import cluster
from orchestrator.testcluster.netns import require_root
from orchestrator.testcluster.state import ClusterState, enter_argv, state_for_launch


def host_records(state: ClusterState, max_nodes: int) -> tuple[HostRecord, ...]:
    """The first ``max_nodes`` hosts as the plan carries them: traffic leaves through each host's own veth."""
    return tuple(HostRecord(address=h.address, hostname=h.hostname,
                            env={"GLOO_SOCKET_IFNAME": h.ifname, "TP_SOCKET_IFNAME": h.ifname,
                                 "ORCH_TESTCLUSTER_HOST": h.hostname},
                            wrapper=enter_argv(h.netns, h.hostname, ()))
                 for h in state.nodes[:max_nodes])


class TestClusterPool(LocalNodePool):
    """Node agents on the first ``max_nodes`` hosts of ``state``."""

    def __init__(self, state: ClusterState, max_nodes: int, echo: Optional[TextIO]):
        super().__init__(slots=1, echo=echo)
        self.state = state
        self.hosts = {h.address: h for h in state.nodes[:max_nodes]}

    def nodes(self) -> list[ClusterNode]:
        return [ClusterNode(h.address, h.address, 1) for h in self.hosts.values() if cluster.link_up(self.state, h.index)]

    def argv(self, spec: AgentSpec, node_id: str) -> tuple[str, ...]:
        host = self.hosts[node_id]
        return enter_argv(host.netns, host.hostname, spec.argv)

    def ip_of(self, node_id: str) -> str:
        return node_id


class TestClusterHooks(RunHooks):
    """The controller's side duties on a test cluster; ``hosts`` (launcher=ray) are the hosts' Ray nodes."""

    def __init__(self, watch, hosts=None, placement: Optional[dict[str, int]] = None):
        self.watch, self.hosts = watch, hosts
        self.placement = placement or {}  # host address -> the node that runs there

    def node_for(self, ip: str, free: list[int]) -> Optional[int]:
        node = self.placement.get(ip)
        return node if node in free else None

    def on_tick(self, agent_pids: dict[int, int], rdzv_id: str) -> Optional[str]:
        if self.hosts is not None and self.hosts.gone():
            return (f"test cluster {self.watch.state.name} was taken down during the run (`orch testcluster down`): "
                    "its hosts, their Ray nodes and the bridge the Ray head listens on are gone")
        self.watch.follow(rdzv_id)
        self.watch.poll(agent_pids, lambda node: node in agent_pids)
        if self.hosts is not None:
            self.hosts.supervise()
        return None

    def explain_exit(self, node: int, exit_code: Optional[int], started_t: float) -> Optional[str]:
        return self.watch.exit_reason(node, 1 if exit_code is None else exit_code, started_t)

    def close(self) -> None:
        self.watch.close()
        if self.hosts is not None:
            self.hosts.close()


class _OnTestCluster:
    """What both test-cluster sites share: the state (read once), the hosts, the store on the bridge."""

    def _read_state(self, cfg: OrchConfig) -> None:
        require_root(f"cluster.testcluster={cfg.cluster.testcluster}")
        self.state = state_for_launch(cfg.cluster.testcluster, cfg.cluster.max_nodes)
        self.hosts = host_records(self.state, cfg.cluster.max_nodes)

    def store_host(self) -> Optional[str]:
        return self.state.bridge_address

    def launch_fields(self) -> dict[str, Any]:
        return {"testcluster": self.state.name}

    def _hooks(self, events: EventLog, store: Any, since: float, ray_hosts=None) -> TestClusterHooks:
        from orchestrator.testcluster.watch import ClusterWatch

        watch = ClusterWatch(self.state, self.cfg.run.dir, self.run_id, events, self.cfg.rendezvous, since=since,
                             store=store)
        return TestClusterHooks(watch, ray_hosts, {h.address: i for i, h in enumerate(self.hosts)})


class LocalTestClusterSite(_OnTestCluster, SiteBase):
    """``launcher=local`` on a test cluster: node i's agent a process entered into host i."""

    name = "local"

    def __init__(self, cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None):
        super().__init__(cfg, run_id, echo)
        self._read_state(cfg)

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        return TestClusterPool(self.state, self.cfg.cluster.max_nodes, self.echo), self._hooks(events, store, since)


class RayTestClusterSite(_OnTestCluster, RaySite):
    """``launcher=ray`` on a test cluster: a Ray head on the bridge, a Ray node on every host."""

    def __init__(self, cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None):
        super().__init__(cfg, run_id, echo)
        self._read_state(cfg)
        self.nodes_here = 0  # the hosts' Ray nodes bring their own (simulated) machines
        self.spread = True

    def connect(self) -> None:
        from orchestrator.testcluster.ray_hosts import start_head

        self.ray_address = start_head(self.state)
        self.embedded = False

    def launch_fields(self) -> dict[str, Any]:
        return {**RaySite.launch_fields(self), **_OnTestCluster.launch_fields(self)}

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        from orchestrator.testcluster.ray_hosts import RayHosts

        ray_hosts = RayHosts(self.state, self.ray_address, self.cfg.cluster.cpus_per_node, self.cfg.run.dir, events)
        try:
            ray_hosts.start_all()
        except BaseException:
            ray_hosts.close()
            raise
        pool, _ = RaySite.start(self, events, store, since)
        return pool, self._hooks(events, store, since, ray_hosts)

    def close(self, pool: Optional[NodePool], hooks: Optional[RunHooks]) -> None:
        gone = isinstance(hooks, TestClusterHooks) and hooks.hosts is not None and hooks.hosts.gone()
        if not gone:  # else the head's address is gone too: a Ray call would hang
            RaySite.close(self, pool, hooks)
            return
        if hooks is not None:
            hooks.close()
        self._stop_echo()
        abandon_ray()
