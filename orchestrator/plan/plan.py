"""The launch plan: what will run where, frozen and printable. Planning is pure: no processes, no network.

The same plan feeds every launcher and ``orch launch --dry-run``: per node, the exact torchrun command line
and the environment added to it, the rendezvous endpoint, and the settings that shape the job.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.ft import ADDR_ENV, QUORUM_ENV
from orchestrator.preemption.notices import SIGTERM_NOTICE_ENV, SIGTERM_NOTICE_FILE
from orchestrator.rendezvous.args import rendezvous_argv, rendezvous_conf, rendezvous_env
from orchestrator.rundir import CONFIG_FILE, PLAN_FILE  # noqa: F401 (re-exported)
from orchestrator.testcluster.state import ClusterState, NodeHost, enter_argv

PORT_PLACEHOLDER = "<port chosen at launch>"
FROM_ENVIRON: Any = object()  # build_plan's default devices: those this process's CUDA_VISIBLE_DEVICES lists


@dataclass(frozen=True)
class NodePlan:
    """One simulated or real node: a torchrun agent command line and the environment added to it."""

    node: int
    argv: tuple[str, ...]
    env: dict[str, str]
    netns: Optional[str] = None
    """Test clusters (``cluster.testcluster``): the network namespace the agent runs in; None: this host's."""
    hostname: Optional[str] = None
    """Test clusters: the node's hostname (its agent's UTS hostname and ``--local-addr``)."""
    address: Optional[str] = None
    """Test clusters: the node's address (with launcher=ray, its agent goes on the Ray node with this IP)."""

    def command_line(self) -> str:
        return shlex.join(self.argv)

    def launch_argv(self) -> tuple[str, ...]:
        """What a launcher on this machine runs: ``argv``, entered into the node's namespace if it has one."""
        return enter_argv(self.netns, self.hostname, self.argv) if self.netns else self.argv


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launcher needs to start a run, derived from the config alone."""

    preset: str
    run_id: str
    run_dir: str
    launcher: str
    backend: str
    device: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rendezvous_endpoint: str
    rendezvous_conf: str
    entrypoint: tuple[str, ...]
    settings: dict[str, Any]
    nodes: tuple[NodePlan, ...]

    @property
    def world_size_range(self) -> tuple[int, int]:
        return self.min_nodes * self.nproc_per_node, self.max_nodes * self.nproc_per_node

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "world_size_range": list(self.world_size_range)}, indent=2)

    def format_text(self) -> str:
        lo, hi = self.world_size_range
        lines = [
            f"launch plan for preset {self.preset!r} (run id {self.run_id})",
            f"  run dir:      {self.run_dir}",
            f"  launcher:     {self.launcher}",
            f"  backend:      {self.backend} on {self.device}",
            f"  nodes:        {self.min_nodes}" + (f"..{self.max_nodes} (elastic)" if hi != lo else "")
            + f" x {self.nproc_per_node} process(es) per node",
            f"  world size:   {lo}" + (f"..{hi}" if hi != lo else ""),
            f"  rendezvous:   c10d at {self.rendezvous_endpoint} (store hosted by the launcher, is_host=false)",
            f"                {self.rendezvous_conf}",
        ]
        for group, values in self.settings.items():
            lines.append(f"  {group + ':':<13} " + ", ".join(f"{k}={v}" for k, v in values.items()))
        if self.settings.get("fault_tolerance", {}).get("mode") == "per_step" and self.min_nodes == self.max_nodes > 1:
            lines.append(f"  note:         per_step with MIN = MAX = {self.max_nodes} nodes: the survivors of a loss keep "
                         f"their state but train only once a replacement joins (cluster.nnodes=1:{self.max_nodes} "
                         "lets them go on)")
        for node in self.nodes:
            lines.append(f"  node {node.node}:")
            if node.netns:
                lines.append(f"    host: {node.hostname} (ip netns exec {node.netns})")
            lines.append(f"    env: {' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(node.env.items()))}")
            lines.append(f"    cmd: {node.command_line()}")
        return "\n".join(lines)


def entrypoint_argv(cfg: OrchConfig, run_dir: str) -> tuple[str, ...]:
    """What torchrun runs on every rank: the built-in trainer, or the user's script or module."""
    e = cfg.entrypoint
    if e.script:
        return (e.script, *map(str, e.args))
    if e.module:
        return ("-m", e.module, *map(str, e.args))
    return ("-m", "orchestrator.runtime.train", "--config", f"{run_dir}/{CONFIG_FILE}")


def torchrun_argv(cfg: OrchConfig, node: int, run_id: str, endpoint: str, run_dir: str,
                  python: str, local_addr: Optional[str] = None) -> tuple[str, ...]:
    c = cfg.cluster
    # per_step: every node is a replica group of its own (one-node rendezvous, its own id per agent, given by
    # the controller): losing a node never touches another node's group. The quorum across them is torchft's.
    nnodes = "1" if cfg.fault_tolerance.mode == "per_step" else f"{c.min_nodes}:{c.max_nodes}"
    # On a test cluster the agent names its own host; rank 0's name becomes the workers' MASTER_ADDR.
    addr = (f"--local-addr={local_addr}",) if local_addr else ()
    # The role names the node, so torchrun's --tee prefixes each worker line with node and local rank
    # ("[node1-local0]:"); per-rank, per-attempt log files go under the run dir's logs/.
    return (
        python, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={c.nproc_per_node}",
        *rendezvous_argv(cfg, endpoint, run_id),
        f"--max-restarts={c.max_restarts}",
        *addr,
        "--monitor-interval=0.5",
        f"--role=node{node}-local",
        "--tee=3",
        f"--log-dir={run_dir}/logs/torchrun/node{node}",
        *entrypoint_argv(cfg, run_dir),
    )


def visible_devices(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The GPUs this machine's processes may use, as ``CUDA_VISIBLE_DEVICES`` names them (indexes or UUIDs);
    None when it is unset: every device, by index 0, 1, ..."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [d.strip() for d in value.split(",") if d.strip()]


def node_gpus(cfg: OrchConfig, node: int, devices: Optional[Sequence[str]]) -> Optional[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of simulated node ``node``, or None to leave it alone.

    Simulated CUDA nodes on one machine (``launcher=local``) each get their own GPUs, node i the i-th
    ``nproc_per_node`` of ``devices`` (the visible ones; None: indexes 0, 1, ...), so their ranks' ``LOCAL_RANK``
    never picks a GPU another node uses. Not for a pod (``cluster.node_index``: one node, the pod's GPUs) or
    Ray (it sets ``CUDA_VISIBLE_DEVICES`` per actor). A node past the end of ``devices`` gets none here: the
    resource check refuses that launch before it starts (a dry run just shows it).
    """
    c = cfg.cluster
    if c.device != "cuda" or cfg.launcher != "local" or c.node_index is not None:
        return None
    first = node * c.nproc_per_node
    if devices is None:
        return ",".join(str(d) for d in range(first, first + c.nproc_per_node))
    mine = list(devices[first:first + c.nproc_per_node])
    return ",".join(mine) if len(mine) == c.nproc_per_node else None


def node_env(cfg: OrchConfig, node: int, run_dir: str, run_id: str,
             devices: Optional[Sequence[str]] = None) -> dict[str, str]:
    """orch's environment for node ``node``'s torchrun agent (added to the agent's own). ``devices``: the
    visible GPUs (see :func:`visible_devices`), which simulated CUDA nodes split between them."""
    env = {"ORCH_RUN_DIR": run_dir, "ORCH_RUN_ID": run_id, "ORCH_NODE": str(node), "PYTHONUNBUFFERED": "1",
           # How long torchrun lets workers finish after forwarding SIGTERM: the emergency checkpoint's window.
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, int(cfg.preemption.grace_period_s))),
           **rendezvous_env(),
           # torchrun SIGTERMs the workers it restarts (a node joined or left): under orch a SIGTERM is a
           # preemption notice only when orch wrote the agent's notice file first (orchestrator/preemption).
           SIGTERM_NOTICE_ENV: SIGTERM_NOTICE_FILE}
    if cfg.cluster.device == "cpu":
        # One intra-op thread per worker: simulated nodes share this machine's cores.
        env["OMP_NUM_THREADS"] = "1"
    gpus = node_gpus(cfg, node, devices)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def per_step_env(cfg: OrchConfig, gate: str, address: str) -> dict[str, str]:
    """fault_tolerance.mode=per_step: where the quorum service is (the run's gate, ``gate``), and the address
    this node's peer state server binds (the run's secret is added when an agent starts, never in the plan)."""
    if cfg.fault_tolerance.mode != "per_step":
        return {}
    return {QUORUM_ENV: gate, ADDR_ENV: address}


def testcluster_env(host: NodeHost) -> dict[str, str]:
    """A test-cluster node's interface for gloo (and TensorPipe): traffic leaves through its own veth."""
    return {"GLOO_SOCKET_IFNAME": host.ifname, "TP_SOCKET_IFNAME": host.ifname, "ORCH_TESTCLUSTER_HOST": host.hostname}


def build_plan(cfg: OrchConfig, run_dir: str, run_id: str, store_port: Optional[int] = None,
               python: str = sys.executable, testcluster: Optional[ClusterState] = None,
               devices: Optional[Sequence[str]] = FROM_ENVIRON) -> LaunchPlan:
    """The plan for ``cfg``. ``store_port`` is known once the launcher hosts the store; a dry run has none.
    ``testcluster`` (the saved state of ``cluster.testcluster``, read by the caller) puts node i on its host i,
    with the store on the cluster's bridge address. ``devices``: the GPUs simulated CUDA nodes split (see
    :func:`node_gpus`); by default this process's ``CUDA_VISIBLE_DEVICES`` (unset: every device by index).
    The plan's env is orch's own per node; the driver's forwarded variables are added when an agent starts
    (orchestrator/controller/agent_env.py), so no secret reaches ``plan.json``."""
    if devices is FROM_ENVIRON:
        devices = visible_devices(os.environ)
    port = store_port or cfg.rendezvous.port or PORT_PLACEHOLDER
    endpoint = f"{testcluster.bridge_address if testcluster else cfg.rendezvous.host}:{port}"
    hosts = testcluster.nodes if testcluster else [None] * cfg.cluster.max_nodes
    nodes = tuple(NodePlan(node=i, argv=torchrun_argv(cfg, i, run_id, endpoint, run_dir, python,
                                                      local_addr=host.hostname if host else None),
                           env={**node_env(cfg, i, run_dir, run_id, devices),
                                **(testcluster_env(host) if host else {}),
                                **per_step_env(cfg, endpoint, host.address if host else cfg.rendezvous.host)},
                           netns=host.netns if host else None, hostname=host.hostname if host else None,
                           address=host.address if host else None)
                  for i, host in zip(range(cfg.cluster.max_nodes), hosts))
    ckpt = cfg.checkpoint
    settings = {
        "ddp": asdict(cfg.ddp),
        "amp": {"enabled": cfg.amp.enabled, "dtype": cfg.amp.dtype if cfg.amp.enabled else "fp32",
                "grad_scaler": cfg.amp.enabled and cfg.amp.dtype == "fp16"},
        "checkpoint": {"url": ckpt.url or f"{run_dir}/checkpoints", "every_n_steps": ckpt.every_n_steps,
                       "keep_last": ckpt.keep_last, "async": ckpt.async_save, "resume": ckpt.resume},
        "fault_tolerance": {"mode": cfg.fault_tolerance.mode,
                            **({"heartbeat_timeout_ms": cfg.fault_tolerance.heartbeat_timeout_ms,
                                "collective_timeout_s": cfg.fault_tolerance.collective_timeout_s}
                               if cfg.fault_tolerance.mode == "per_step" else {})},
        "trainer": {"max_steps": cfg.trainer.max_steps, "global_batch_size": cfg.trainer.global_batch_size,
                    "micro_batch_size": cfg.trainer.micro_batch_size},
        "model": {"target": cfg.model.get("_target_")},
    }
    return LaunchPlan(
        preset=cfg.preset, run_id=run_id, run_dir=run_dir, launcher=cfg.launcher, backend=cfg.backend.name,
        device=cfg.cluster.device, min_nodes=cfg.cluster.min_nodes, max_nodes=cfg.cluster.max_nodes,
        nproc_per_node=cfg.cluster.nproc_per_node, rendezvous_endpoint=endpoint, rendezvous_conf=rendezvous_conf(cfg),
        entrypoint=entrypoint_argv(cfg, run_dir), settings=settings, nodes=nodes,
    )
