"""Gloo ranks for tests/test_parallel.py: each rank trains the built-in BertMLM (tiny) through a parallelism
strategy (orchestrator/parallel/) as the built-in trainer does (wrap, optimizer over the wrapped module,
accumulation under no_sync, clipping and scaler from the strategy) and rank 0 writes what it saw to a JSON file.
One spawn runs several cases in turn, since starting processes is what costs."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchestrator.trainer.train import leave

STEPS, MICRO, ACCUMULATION = 4, 2, 2


def run_ranks(world: int, store_dir: str, cases: list[dict]) -> list[dict]:
    """Run ``cases`` (:func:`_case`'s keywords) on ``world`` processes over a FileStore; rank 0's results."""
    os.makedirs(store_dir, exist_ok=True)
    mp.start_processes(_rank, args=(world, store_dir, cases), nprocs=world, start_method="spawn", join=True)
    return json.load(open(f"{store_dir}/rank0.json"))


def _rank(rank: int, world: int, store_dir: str, cases: list[dict]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    store = dist.FileStore(f"{store_dir}/store", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results = [_case(rank, world, **case) for case in cases]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(f"{store_dir}/rank0.json", "w") as f:  # closed (written) before leave's os._exit
            json.dump(results, f)
    leave(0)  # as dcp_ranks: a normal interpreter exit after gloo could abort the rank (SIGABRT)


def _case(rank: int, world: int, overrides: list[str], expect_error: bool = False,
          local_world: int | None = None, session: bool = False, build: bool = False) -> dict[str, Any]:
    """Train STEPS steps of the tiny model under ``overrides`` (of conf=cpu_gloo); every rank sees the same
    global batch, split by rank, so every strategy trains on the same data. ``local_world``: the processes per
    node this case's ranks are told they run with (LOCAL_WORLD_SIZE; default: every rank on one node).
    ``session``: wrap through ``Session.wrap`` and use ``Session.strategy``, as a user's script does.
    ``build``: the strategy builds the model from a factory (``Strategy.build``, as the built-in trainer does);
    the model then carries a persistent and a non-persistent buffer, and the result says on which device each
    rank's factory built it, its local parameter bytes right after the build and the buffers it ended with."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world or world)
    from orchestrator.config.compose import compose_config
    from orchestrator.parallel import strategy_for
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.runtime.models import BertMLM
    from orchestrator.runtime.precision import MixedPrecision

    cfg = compose_config("cpu_gloo", overrides)
    strategy, device = strategy_for(cfg), torch.device("cpu")
    torch.manual_seed(rank)  # different on every rank: the strategy must start every rank from rank 0's model
    model = BertMLM(512, 64, 2, 4, 256, 16) if not build else None
    built: dict[str, Any] = {}
    try:
        if build:
            wrapped = strategy.build(lambda: _factory(built), DistContext.from_env(), device)
            built["local_bytes"] = _local_bytes(wrapped)
            built["buffers"] = {name: b.tolist() for name, b in wrapped.head_transform.named_buffers()}
        elif session:
            from orchestrator.elastic import Session

            user = Session(cfg)
            wrapped, strategy = user.wrap(model), user.strategy
        else:
            wrapped = strategy.wrap(model, DistContext.from_env(), device)
    except Exception as exc:  # noqa: BLE001 - the case is about what each rank raises
        if not expect_error:
            raise
        return {"error": f"{type(exc).__name__}: {exc}"}
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    scaler = strategy.grad_scaler(cfg.amp.enabled and cfg.amp.dtype == "fp16", device)
    precision = MixedPrecision(cfg.amp.enabled, cfg.amp.dtype, device, scaler=scaler)
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        batch = torch.randint(1, 512, (MICRO * ACCUMULATION * world, 16), generator=g)
        mine = batch.view(world, ACCUMULATION, MICRO, 16)[rank]
        total = torch.zeros(())
        for micro in range(ACCUMULATION):
            sync = micro == ACCUMULATION - 1
            with (contextlib.nullcontext() if sync else strategy.no_sync(wrapped)), precision.autocast():
                loss = wrapped(mine[micro], mine[micro]) / ACCUMULATION
            scaler.scale(loss).backward()
            total += loss.detach()
        scaler.unscale_(optim)
        norms.append(float(strategy.clip_grad_norm_(wrapped, 0.5)))
        scaler.step(optim)
        scaler.update()
        optim.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    from orchestrator.runtime.state import params_sha256
    from torch.distributed.tensor import DTensor

    from orchestrator.elastic import collectives

    every = collectives.all_gather_object(built, world)  # what each rank's build saw

    params = list(strategy.unwrap(wrapped).parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    mesh = params[0].device_mesh if isinstance(params[0], DTensor) else None
    return {"losses": losses, "norms": norms, "scaler": type(scaler).__name__, "local_numel": local,
            "numel": sum(p.numel() for p in params), "sha": params_sha256(strategy.unwrap(wrapped)),
            "mesh": list(mesh.shape) if mesh is not None else None,
            "mesh_dims": list(mesh.mesh_dim_names or ()) if mesh is not None else None, "built": every}


def _factory(built: dict[str, Any]) -> torch.nn.Module:
    """The tiny model with two buffers (one in no state dict); notes the device it was built on."""
    from orchestrator.runtime.models import BertMLM

    model = BertMLM(512, 64, 2, 4, 256, 16)
    model.head_transform.register_buffer("kept", torch.arange(3.0))
    model.head_transform.register_buffer("scratch", torch.full((3,), 2.0), persistent=False)
    built["device"] = next(model.parameters()).device.type
    built["full_bytes"] = _local_bytes(model)
    return model


def _local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor: its shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
