"""Does this machine have what the plan needs? Checked before anything starts (after --dry-run exits)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from orchestrator.errors import EnvironmentMismatch
from orchestrator.plan.plan import LaunchPlan


def gpus_needed_here(plan: LaunchPlan) -> int:
    """The local launcher runs every node on this machine: each needs nproc_per_node GPUs."""
    return plan.max_nodes * plan.nproc_per_node if plan.launcher == "local" else plan.nproc_per_node


def check_local_resources(plan: LaunchPlan) -> None:
    """Raise EnvironmentMismatch (exit 2) when the plan needs CUDA or NCCL this machine lacks."""
    if plan.device == "cuda" or plan.backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = gpus_needed_here(plan)
        if have < need:
            raise EnvironmentMismatch(
                f"cluster.device=cuda: preset {plan.preset!r} needs {need} CUDA GPU(s) on this machine "
                f"({plan.nproc_per_node} per node), but it has {have}. Fix: `orch launch conf={plan.preset} --dry-run` "
                "shows the plan without running it; `orch launch conf=cpu_gloo` runs on CPUs")
    if plan.backend == "nccl" and not dist.is_nccl_available():
        raise EnvironmentMismatch("backend.name=nccl: this torch build has no NCCL. Fix: install a CUDA build of "
                                  "torch, or use backend=gloo")
