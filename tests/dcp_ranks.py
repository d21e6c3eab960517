"""Gloo ranks for the DCP engine's tests (tests/test_dcp_checkpoints.py): each rank trains a small MLP under DDP,
FSDP2 (``fully_shard`` per layer on a CPU device mesh) or HSDP (the same on a 2-D mesh), checkpoints through SessionCheckpoints with the
``dcp`` engine, and writes what it ended with (hashes of the full model and optimizer state) to a JSON file.
Run with :func:`run_ranks` (``torch.multiprocessing`` spawn; tests/ is on the children's path): one launch runs
several phases in turn (each a model of its own at its own URL), since starting processes is what costs."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchestrator.trainer.train import leave

DIM, GLOBAL_BATCH = 16, 12


def run_ranks(world: int, store_dir: str, *phases: dict) -> list[dict]:
    """Run ``phases`` (each :func:`_phase`'s keywords) on ``world`` processes; rank 0's result of each."""
    os.makedirs(store_dir, exist_ok=True)
    mp.start_processes(_rank, args=(world, store_dir, phases), nprocs=world, start_method="spawn", join=True)
    return json.load(open(f"{store_dir}/rank0.json"))


def digest(flat: dict) -> str:
    """sha256 over a flat state dict's keys and tensor bytes, in key order."""
    h = hashlib.sha256()
    for k in sorted(flat):
        v = flat[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def full_hashes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of the full (unsharded) model and optimizer tensors, by FQN: equal only when bit-identical."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    msd, osd = get_state_dict(model, [optim], options=StateDictOptions(full_state_dict=True))

    return {"model": digest(msd), "optim": digest(flatten_state_dict(osd)[0])}


def _model(strategy: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    if strategy in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # hsdp: replicated across the first dimension, sharded along the second (2 ranks: 2 x 1).
        mesh = init_device_mesh("cpu", (world,)) if strategy == "fsdp2" else init_device_mesh(
            "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return torch.nn.parallel.DistributedDataParallel(model)


def _rank(rank: int, world: int, store_dir: str, phases: tuple[dict, ...]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    try:
        results = [_phase(rank, world, **kw) for kw in phases]
        with open(f"{store_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
    # As orch's trainer leaves: a normal interpreter exit after gloo could abort the rank (SIGABRT, "terminate
    # called without an active exception": a gloo thread that needs the GIL while the interpreter finalizes).
    leave(0)


def _phase(rank: int, world: int, url: str, steps: int, strategy: str = "ddp", save_at: tuple = (),
           async_save: bool = False, keep_last: int = 3, resume: str = "auto", finish: bool = True,
           engine: str = "dcp") -> dict:
    """Restore from ``url``, train to ``steps`` saving at ``save_at``, then finish (a final save) or only wait;
    ``engine``: the checkpoint engine (``rank0``: a DDP run's default)."""
    from orchestrator.config.schema import CheckpointConfig
    from orchestrator.elastic.checkpoints import SessionCheckpoints
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.runtime.state import Progress, TrainingState

    model = _model(strategy, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    state = TrainingState(Progress())
    state.register({"model": model, "optim": optim, "sched": sched})
    cfg = CheckpointConfig(async_save=async_save, keep_last=keep_last, resume=resume)
    events: list[dict] = []
    ckpt = SessionCheckpoints(cfg, url, state, DistContext(rank, world, rank, world, 0, 0), torch.device("cpu"), 0,
                              lambda e: events.append({"event": e.event, **e.fields()}), engine=engine)
    restored: Optional[int] = ckpt.restore()
    loaded = full_hashes(model, optim) if restored is not None else None
    saved: dict[str, Any] = {}
    while state.progress.step < steps:
        step = state.progress.step
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(GLOBAL_BATCH, DIM, generator=gen), torch.randn(GLOBAL_BATCH, 1, generator=gen)
        noise = torch.rand(1).item()  # the RNG state travels with the checkpoint: the same draw after resume
        loss = ((model(x[rank::world]) - y[rank::world]) ** 2).mean() * (1 + 1e-3 * noise)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        state.progress.step += 1
        state.progress.samples_consumed += GLOBAL_BATCH
        if state.progress.step in save_at:
            ckpt.save()
            saved[str(state.progress.step)] = full_hashes(model, optim)
    if finish:
        ckpt.finish()
    else:
        ckpt.wait()
    return {"restored": restored, "loaded": loaded, "saved": saved, "final": full_hashes(model, optim),
            "lr": sched.get_last_lr()[0], "events": events}
