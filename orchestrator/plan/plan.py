"""The launch plan: what will run where, frozen and printable. Planning is pure: no processes, no network.

The same plan feeds every launcher and ``orch launch --dry-run``: per node, the agent's template (its torchrun
command but for the rendezvous each agent gets from the fault-tolerance mode), the environment added to it and,
where a site pins nodes to hosts, the host; the rendezvous endpoint, and the settings that shape the job.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.ft.driver import DriverMode, driver_mode
from orchestrator.plan.agent import AgentTemplate
from orchestrator.plan.hosts import HostRecord
from orchestrator.preemption.notices import SIGTERM_NOTICE_ENV, SIGTERM_NOTICE_FILE
from orchestrator.rendezvous.args import rendezvous_conf, rendezvous_env
from orchestrator.rundir import CONFIG_FILE, PLAN_FILE  # noqa: F401 (re-exported)

PORT_PLACEHOLDER = "<port chosen at launch>"
SECRET_SHOWN = "<secret>"  # what --dry-run shows for the run's secret in an agent's environment
FROM_ENVIRON: Any = object()  # build_plan's default devices: those this process's CUDA_VISIBLE_DEVICES lists
BUILTIN_TRAINER = "orchestrator.trainer.train"  # python -m ...: the built-in trainer


@dataclass(frozen=True)
class NodePlan:
    """One simulated or real node: its agent's template, the environment added to it, and its host."""

    node: int
    agent: AgentTemplate
    env: dict[str, str]
    host: Optional[HostRecord] = None
    """Where the node runs when its site pins nodes to hosts (a test cluster); None: wherever the pool places it."""
    argv: tuple[str, ...] = ()
    """The command of the node's first agent (what ``--dry-run`` and ``plan.json`` show)."""

    def command_line(self) -> str:
        return shlex.join(self.host.run(self.argv) if self.host else self.argv)


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
    notes: tuple[str, ...] = ()
    """What ``--dry-run`` warns about (a cluster shape the fault-tolerance mode handles poorly, say)."""

    @property
    def world_size_range(self) -> tuple[int, int]:
        return self.min_nodes * self.nproc_per_node, self.max_nodes * self.nproc_per_node

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "world_size_range": list(self.world_size_range)}, indent=2)

    def format_text(self, secret_env: Sequence[str] = ()) -> str:
        """The plan as ``--dry-run`` prints it; ``secret_env``: variables every agent gets whose values are
        never shown (the run's secret)."""
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
        lines += [f"  note:         {note}" for note in self.notes]
        for node in self.nodes:
            lines.append(f"  node {node.node}:")
            if node.host:
                lines.append(f"    host: {node.host.hostname} at {node.host.address}")
            env = {**node.env, **dict.fromkeys(secret_env, SECRET_SHOWN)}
            lines.append(f"    env: {' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(env.items()))}")
            lines.append(f"    cmd: {node.command_line()}")
        return "\n".join(lines)


def entrypoint_argv(cfg: OrchConfig, run_dir: str) -> tuple[str, ...]:
    """What torchrun runs on every rank: the built-in trainer, or the user's script or module."""
    e = cfg.entrypoint
    if e.script:
        return (e.script, *map(str, e.args))
    if e.module:
        return ("-m", e.module, *map(str, e.args))
    return ("-m", BUILTIN_TRAINER, "--config", f"{run_dir}/{CONFIG_FILE}")


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


def build_plan(cfg: OrchConfig, run_dir: str, run_id: str, store_port: Optional[int] = None,
               store_host: Optional[str] = None, hosts: Optional[Sequence[HostRecord]] = None,
               python: str = sys.executable, devices: Optional[Sequence[str]] = FROM_ENVIRON,
               mode: Optional[DriverMode] = None, node_address: Optional[str] = None) -> LaunchPlan:
    """The plan for ``cfg``. ``store_port`` is known once the launch binds the store; a dry run has none.
    ``store_host``: where agents dial the store (default ``rendezvous.host``; a site may know better: the Ray
    driver's IP, a test cluster's bridge). ``hosts``: node i runs on ``hosts[i]`` (a site that pins nodes).
    ``devices``: the GPUs simulated CUDA nodes split (see :func:`node_gpus`); by default this process's
    ``CUDA_VISIBLE_DEVICES`` (unset: every device by index). ``mode``: the fault-tolerance mode's driver side
    (default: the config's). ``node_address``: a node's own address where no host pins it (default
    ``rendezvous.host``; a site whose machines are known only at start passes a placeholder its pool fills in). The plan's env is orch's own per node; the driver's forwarded variables and the
    run's secret are added when an agent starts (orchestrator/controller/agent_env.py), so no secret reaches
    ``plan.json``."""
    if devices is FROM_ENVIRON:
        devices = visible_devices(os.environ)
    mode = mode or driver_mode(cfg)
    port = store_port or cfg.rendezvous.port or PORT_PLACEHOLDER
    endpoint = f"{store_host or cfg.rendezvous.host}:{port}"
    conf = rendezvous_conf(cfg)
    c = cfg.cluster
    nodes = []
    for i in range(c.max_nodes):
        host = hosts[i] if hosts else None
        agent = AgentTemplate(python=python, nproc_per_node=c.nproc_per_node, rendezvous_endpoint=endpoint,
                              rendezvous_conf=conf, max_restarts=c.max_restarts, role=f"node{i}-local",
                              log_dir=f"{run_dir}/logs/torchrun/node{i}", entrypoint=entrypoint_argv(cfg, run_dir),
                              local_addr=host.hostname if host else None)
        first = mode.agent_rendezvous(run_id, i, i, 0)
        env = {**node_env(cfg, i, run_dir, run_id, devices), **(host.env if host else {}),
               **mode.plan_env(endpoint, host.address if host else node_address or cfg.rendezvous.host)}
        nodes.append(NodePlan(node=i, agent=agent, env=env, host=host, argv=agent.command(first)))
    ckpt = cfg.checkpoint
    settings = {
        **({} if cfg.parallelism.sharded else {"ddp": asdict(cfg.ddp)}),  # DDP's flags; a sharded run has no DDP
        "parallelism": parallelism_settings(cfg),
        "amp": {"enabled": cfg.amp.enabled, "dtype": cfg.amp.dtype if cfg.amp.enabled else "fp32",
                "grad_scaler": cfg.amp.enabled and cfg.amp.dtype == "fp16"},
        "checkpoint": {"url": ckpt.url or f"{run_dir}/checkpoints", "every_n_steps": ckpt.every_n_steps,
                       "keep_last": ckpt.keep_last, "async": ckpt.async_save, "resume": ckpt.resume},
        "fault_tolerance": mode.plan_settings(),
        "trainer": {"max_steps": cfg.trainer.max_steps, "global_batch_size": cfg.trainer.global_batch_size,
                    "micro_batch_size": cfg.trainer.micro_batch_size},
        "model": {"target": cfg.model.get("_target_")},
        "optim": _target_settings(cfg.optim),
        "scheduler": _target_settings(cfg.scheduler),
    }
    return LaunchPlan(
        preset=cfg.preset, run_id=run_id, run_dir=run_dir, launcher=cfg.launcher, backend=cfg.backend.name,
        device=cfg.cluster.device, min_nodes=cfg.cluster.min_nodes, max_nodes=cfg.cluster.max_nodes,
        nproc_per_node=cfg.cluster.nproc_per_node, rendezvous_endpoint=endpoint, rendezvous_conf=rendezvous_conf(cfg),
        entrypoint=entrypoint_argv(cfg, run_dir), settings=settings, nodes=tuple(nodes),
        notes=tuple(mode.plan_notes()),
    )


def _target_settings(group: Any) -> dict[str, Any]:
    """A ``_target_`` group (``optim``, ``scheduler``) as the plan shows it: its class, then its arguments."""
    values = dict(group or {})
    return {"target": values.pop("_target_", None), **values}


def parallelism_settings(cfg: OrchConfig) -> dict[str, Any]:
    """The strategy and, for a sharded one, its options and device mesh at the job's world sizes."""
    p, c = cfg.parallelism, cfg.cluster
    if not p.sharded:
        return {"strategy": p.strategy}
    nodes = f"{c.min_nodes}..{c.max_nodes}" if c.elastic else str(c.min_nodes)
    ranks = f"{c.min_nodes * c.nproc_per_node}..{c.max_nodes * c.nproc_per_node}" if c.elastic else \
        str(c.min_nodes * c.nproc_per_node)
    mesh = f"(replicate {nodes}, shard {c.nproc_per_node})" if p.strategy == "hsdp" else f"(shard {ranks})"
    return {"strategy": p.strategy, "mesh": mesh, "reshard_after_forward": p.reshard_after_forward,
            "shard_modules": ",".join(p.shard_modules) or "the model's blocks",
            "activation_checkpointing": p.activation_checkpointing}
