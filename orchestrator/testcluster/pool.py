"""A test cluster as a node pool and run hooks: what a launch does differently on ``cluster.testcluster``.

- ``TestClusterPool``: agents as processes on this machine, each entered into its host's network namespace;
  every host is a machine with one slot, listed only while its link is up (a partitioned host gets no agent,
  a healed one gets one again through the controller's ordinary growth).
- ``TestClusterHooks``: every controller tick records the cluster's faults as run events, breaks a round a
  partition left hanging, ends a healed host's stale workers, and (launcher=ray) keeps the hosts' Ray nodes up.
"""

from __future__ import annotations

from typing import Optional, TextIO

from orchestrator.controller.api import AgentSpec, ClusterNode, RunHooks
from orchestrator.controller.pools.local import LocalNodePool
from orchestrator.testcluster import cluster
from orchestrator.testcluster.state import ClusterState, enter_argv


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

    def __init__(self, watch, hosts=None):
        self.watch, self.hosts = watch, hosts

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
