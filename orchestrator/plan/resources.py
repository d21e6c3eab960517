"""Does this machine have what the plan needs? Checked before anything starts (after --dry-run exits)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from orchestrator.config.schema import ClusterConfig
from orchestrator.errors import EnvironmentMismatch
from orchestrator.plan.plan import LaunchPlan


def nodes_here(plan: LaunchPlan, cluster: ClusterConfig) -> int:
    """How many of the plan's nodes run on this machine: one for a pod running one node (``node_index``),
    none when joining a Ray cluster (its nodes bring their own GPUs; the controller waits for placeable
    ones), else all of them (the local launcher, and the embedded Ray packing agents on this machine)."""
    if cluster.node_index is not None:
        return 1
    if plan.launcher == "ray" and (cluster.address or cluster.testcluster):
        return 0
    return plan.max_nodes


def check_local_resources(plan: LaunchPlan, cluster: ClusterConfig) -> None:
    """Raise EnvironmentMismatch (exit 2) when the nodes that run here need CUDA or NCCL this machine lacks."""
    here = nodes_here(plan, cluster)
    if here == 0:
        return
    if plan.device == "cuda" or plan.backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = here * plan.nproc_per_node
        if have < need:
            raise EnvironmentMismatch(
                f"cluster.device=cuda: preset {plan.preset!r} needs {need} CUDA GPU(s) on this machine "
                f"({plan.nproc_per_node} per node, {here} node(s) here), but it has {have}. Fix: "
                f"`orch launch conf={plan.preset} --dry-run` shows the plan without running it; "
                "`orch launch conf=cpu_gloo` runs on CPUs")
    if plan.backend == "nccl" and not dist.is_nccl_available():
        raise EnvironmentMismatch("backend.name=nccl: this torch build has no NCCL. Fix: install a CUDA build of "
                                  "torch, or use backend=gloo")
