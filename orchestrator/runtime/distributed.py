"""The process group, from the environment torchrun gives every worker."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestrator.errors import EnvironmentMismatch


@dataclass
class DistContext:
    """Who this worker is, as torchrun's environment says (a lone process outside torchrun is rank 0 of 1)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    """torchrun's group rank in the current round (it changes as nodes come and go)."""
    restart_count: int
    node: int = 0
    """orch's node index (``ORCH_NODE``, set by the launcher; the group rank outside orch): what run events name."""

    @classmethod
    def from_env(cls) -> "DistContext":
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            node=int(env.get("ORCH_NODE", env.get("GROUP_RANK", 0))),
        )

    replicas: int = 1
    """Replica groups training together in this step (the quorum's size in a mode that makes every node a
    replica group; 1 otherwise). Set by the fault-tolerance mode (orchestrator/ft/steps.py)."""
    leader: bool = True
    """Whether this worker's replica group leads the job's records (where every node is a replica group with a
    rank 0 of its own, the quorum's first participant writes the run's metrics, events and checkpoints;
    otherwise always)."""

    @property
    def job_world_size(self) -> int:
        """Ranks training the job's global batch: this group's ranks times the replica groups."""
        return self.world_size * self.replicas

    @property
    def is_main(self) -> bool:
        """Rank 0 of the leading replica group: the worker that writes the run's records."""
        return self.rank == 0 and self.leader


def select_device(kind: str, local_rank: int) -> torch.device:
    """``cpu``, or the GPU of this worker's LOCAL_RANK (made current so NCCL and allocations land there)."""
    if kind == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise EnvironmentMismatch(f"cluster.device=cuda: LOCAL_RANK {local_rank} needs GPU {local_rank}, but this "
                                  f"machine has {count} CUDA device(s). Fix: lower cluster.nproc_per_node or use cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(ctx: DistContext, backend: str, timeout_s: float) -> None:
    """Join the job's process group; a lone process gets a private world of one."""
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
