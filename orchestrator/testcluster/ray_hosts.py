"""``launcher=ray`` on a test cluster: a Ray node on every test host, joined to a head on the bridge.

The head runs in the host namespace, in the launching process (as the embedded Ray does), bound to the
cluster's bridge address and offering no CPUs, so no agent lands on it. Each test host runs ``ray start
--block`` inside its namespace with its own address as the node IP: the raylet, the node agent actor it
hosts, that actor's torchrun and its workers all live on the host's address, and everything between them
and the head or the store crosses the host's veth. The controller places node i's agent on the Ray node
whose IP is host i's address (``NodePlan.address``).

A host whose Ray node is gone (``orch testcluster kill``, or a raylet that quit after a partition because
the head had declared it dead) gets a fresh Ray node once its link is up: the machine came back, and the
controller grows the job onto it as onto any new Ray node.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from orchestrator.errors import EnvironmentMismatch
from orchestrator.events import TestclusterRayNodeStarted
from orchestrator.rundir import EventLog
from orchestrator.testcluster import cluster
from orchestrator.testcluster.state import ClusterState, enter_argv

READY_TIMEOUT_S = 90.0
RESTART_BACKOFF_S = 5.0
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # per node: orch passes no large objects


def start_head(state: ClusterState) -> str:
    """``ray.init`` a head on the bridge address with no CPUs; returns its GCS address (HOST:PORT)."""
    import ray

    try:
        info = ray.init(address="local", _node_ip_address=state.bridge_address, num_cpus=0, include_dashboard=False,
                        object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False, logging_level=logging.WARNING,
                        namespace="orch")
    except Exception as exc:
        raise EnvironmentMismatch(f"cluster.testcluster={state.name}: the Ray head on {state.bridge_address} did not "
                                  f"start ({type(exc).__name__}: {exc}). Fix: launcher=local runs without Ray") from None
    return info.address_info["gcs_address"]


class RayHosts:
    """The Ray worker nodes of a test cluster: one ``ray start --block`` per host, started, watched, ended."""

    def __init__(self, state: ClusterState, gcs_address: str, cpus_per_node: float, run_dir: str,
                 events: Optional[EventLog] = None):
        self.state, self.gcs, self.events = state, gcs_address, events
        self.cpus = max(1, int(-(-cpus_per_node // 1)))  # whole CPUs, at least the agent's reservation
        self.logs = Path(run_dir) / "logs"
        self.procs: dict[int, subprocess.Popen] = {}
        self._next_try: dict[int, float] = {}

    def _argv(self, node: int) -> tuple[str, ...]:
        host = self.state.nodes[node]
        ray_cli = str(Path(sys.executable).with_name("ray"))
        return enter_argv(host.netns, host.hostname, (
            ray_cli, "start", f"--address={self.gcs}", f"--node-ip-address={host.address}", f"--num-cpus={self.cpus}",
            "--num-gpus=0", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats", "--block"))

    def start(self, node: int, restart: bool = False) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"ray-node{node}.log").open("a")
        # The head wrote this machine's token (~/.ray); the nodes read it, as `ray start` on another machine would.
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.procs[node] = subprocess.Popen(self._argv(node), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        log.close()
        if self.events:
            host = self.state.nodes[node]
            self.events.write(TestclusterRayNodeStarted(node=node, host=host.hostname, address=host.address,
                                                        pid=self.procs[node].pid, restart=restart))

    def start_all(self) -> None:
        # One at a time: nodes on one machine share the session dir, and raylets starting together pick the
        # same socket names there (bind: Address already in use).
        for node in range(len(self.state.nodes)):
            self.start(node)
            self.wait_ready([node])

    def gone(self) -> bool:
        """``orch testcluster down`` removed the cluster: its hosts, and the bridge the head listens on."""
        return not os.path.exists(f"/sys/class/net/{self.state.bridge}")

    def alive_addresses(self) -> set[str]:
        import ray

        return {n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}

    def wait_ready(self, nodes, timeout_s: float = READY_TIMEOUT_S) -> None:
        want = {self.state.nodes[n].address for n in nodes}
        deadline = time.monotonic() + timeout_s
        while not want <= self.alive_addresses():
            for node, proc in self.procs.items():
                if proc.poll() is not None:
                    raise EnvironmentMismatch(
                        f"cluster.testcluster={self.state.name}: the Ray node on {self.state.nodes[node].hostname} exited "
                        f"with code {proc.returncode} (see logs/ray-node{node}.log). Fix: launcher=local runs without Ray")
            if time.monotonic() > deadline:
                missing = sorted(want - self.alive_addresses())
                raise EnvironmentMismatch(f"cluster.testcluster={self.state.name}: Ray nodes on {', '.join(missing)} did not "
                                          f"join the head within {timeout_s:g} s (see logs/ray-node*.log). "
                                          "Fix: launcher=local runs without Ray")
            time.sleep(0.5)

    def supervise(self) -> None:
        """A host whose Ray node process ended and whose link is up gets a fresh Ray node (backed off)."""
        now = time.monotonic()
        for node, proc in list(self.procs.items()):
            if proc.poll() is None or now < self._next_try.get(node, 0.0):
                continue
            self._next_try[node] = now + RESTART_BACKOFF_S
            if not cluster.link_up(self.state, node):
                continue  # still cut off: nothing could join the head from there
            if self.state.nodes[node].address in self.alive_addresses():
                continue  # the head has not declared the old node dead yet (a raylet may still be going down)
            self.start(node, restart=True)
            return  # one start per tick, for the same reason as in start_all

    def close(self) -> None:
        from orchestrator.processes import terminate_tree

        for proc in self.procs.values():
            if proc.poll() is None:
                terminate_tree(proc.pid, grace_s=10.0)
            proc.wait()
        self.procs.clear()
