"""``orch bench ckpt``: training stall of a synchronous vs an asynchronous checkpoint save, side by side, for
both engines: today's ``rank0`` one (``CheckpointManager.save``) and ``dcp`` (torch DCP, sync ``dcp.save`` vs
``dcp.async_save``, through orch's DCP engine in one process).

The stall is what the training loop feels: the time a save blocks. The four kinds of save alternate inside one
run on the same model and disk, so machine noise hits all alike; each number is the median over ``repeats``. An
async save's ``wait()`` runs outside the measured stall (in a real loop the write overlaps the next training
steps).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from typing import Any

import torch
from torch import nn

from orchestrator.checkpoint import CheckpointManager
from orchestrator.checkpoint.dcp_engine import DcpEngine
from orchestrator.elastic import collectives
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Progress, TrainingState

_WIDTH = 1024
_BYTES_PER_PARAM = 3 * 4  # fp32 parameter + AdamW exp_avg + exp_avg_sq


def _build(size_mb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of Linear layers whose parameters plus both Adam moments total about ``size_mb`` MB."""
    params = max(1.0, size_mb * 1e6 / _BYTES_PER_PARAM)
    per_layer = _WIDTH * _WIDTH + _WIDTH
    if params >= per_layer:
        width, layers = _WIDTH, max(1, round(params / per_layer))
    else:
        width, layers = max(1, int(math.sqrt(params))), 1
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    width = model[0].in_features
    loss = model(torch.randn(8, width)).square().mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def _state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def run_ckpt_bench(size_mb: float = 100, repeats: int = 3, url: str | None = None) -> dict:
    """Median save stall in seconds for sync and async saves of a ~``size_mb`` MB model+AdamW state.

    Saves go under ``url`` (``<url>/sync`` and ``<url>/async``) or a temporary local dir that is removed
    afterwards. Returns ``{"sync_stall_s", "async_stall_s", "ratio" (async/sync), "state_mb"}`` for the rank0
    engine, plus ``dcp_sync_stall_s``, ``dcp_async_stall_s`` and the ratios ``dcp_async_over_dcp_sync``,
    ``dcp_async_over_rank0_async``, ``dcp_sync_over_rank0_sync``.
    """
    torch.manual_seed(0)
    model, optim = _build(size_mb)
    for _ in range(2):  # populate the Adam moments so the optimizer state has its full size
        _train_step(model, optim)
    state_mb = _state_bytes({"model": model.state_dict(), "optim": optim.state_dict()}) / 1e6
    with tempfile.TemporaryDirectory(prefix="orch-bench-ckpt-") as tmp:
        base = (url or tmp).rstrip("/")
        sync_mgr = CheckpointManager(f"{base}/sync", keep_last=1, async_save=False)
        async_mgr = CheckpointManager(f"{base}/async", keep_last=1, async_save=True)
        sync_mgr.preflight()
        async_mgr.preflight()
        dcp_sync, dcp_async = (_dcp_engine(f"{base}/dcp_{kind}", model, optim, kind == "async")
                               for kind in ("sync", "async"))
        sync_stalls, async_stalls, dcp_sync_stalls, dcp_async_stalls = [], [], [], []
        for i in range(repeats):
            _train_step(model, optim)
            sync_stalls.append(sync_mgr.save(i, {"model": model.state_dict(), "optim": optim.state_dict()}, {}))
            _train_step(model, optim)
            async_stalls.append(async_mgr.save(i, {"model": model.state_dict(), "optim": optim.state_dict()}, {}))
            async_mgr.wait()  # outside the stall: a real loop keeps training while the write runs
            _train_step(model, optim)
            dcp_sync_stalls.append(dcp_sync.save(i, {}, {}))
            _train_step(model, optim)
            dcp_async_stalls.append(dcp_async.save(i, {}, {}))
            dcp_async.wait()
    sync_s, async_s = statistics.median(sync_stalls), statistics.median(async_stalls)
    dcp_sync_s, dcp_async_s = statistics.median(dcp_sync_stalls), statistics.median(dcp_async_stalls)
    return {
        "sync_stall_s": sync_s,
        "async_stall_s": async_s,
        "ratio": _ratio(async_s, sync_s),
        "state_mb": state_mb,
        "dcp_sync_stall_s": dcp_sync_s,
        "dcp_async_stall_s": dcp_async_s,
        "dcp_async_over_dcp_sync": _ratio(dcp_async_s, dcp_sync_s),
        "dcp_async_over_rank0_async": _ratio(dcp_async_s, async_s),
        "dcp_sync_over_rank0_sync": _ratio(dcp_sync_s, sync_s),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _dcp_engine(url: str, model: nn.Module, optim: torch.optim.Optimizer, async_save: bool) -> DcpEngine:
    """orch's DCP engine over ``model`` and ``optim`` in this one process (DCP's ``no_dist``)."""
    state = TrainingState(Progress())
    state.register({"model": model, "optim": optim})
    manager = CheckpointManager(url, keep_last=1, async_save=async_save)
    manager.preflight()
    return DcpEngine(manager, state, DistContext(0, 1, 0, 1, 0, 0), collectives, async_save)


def main_ckpt_bench(out: str | None, size_mb: float) -> dict:
    """Run :func:`run_ckpt_bench`, print a small table, write the result as JSON to ``out`` if given."""
    result = run_ckpt_bench(size_mb=size_mb)
    print(f"checkpoint save stall, {result['state_mb']:.1f} MB model+AdamW state (median of 3)")
    print(f"  {'engine':<7} {'mode':<6} {'stall':>10}")
    for engine, mode, key in (("rank0", "sync", "sync_stall_s"), ("rank0", "async", "async_stall_s"),
                              ("dcp", "sync", "dcp_sync_stall_s"), ("dcp", "async", "dcp_async_stall_s")):
        print(f"  {engine:<7} {mode:<6} {result[key] * 1e3:>8.1f}ms")
    print(f"  async/sync = {result['ratio']:.3f} (target <= 0.1)")
    print(f"  dcp async/dcp sync = {result['dcp_async_over_dcp_sync']:.3f}  dcp async/rank0 async = "
          f"{result['dcp_async_over_rank0_async']:.3f}  dcp sync/rank0 sync = {result['dcp_sync_over_rank0_sync']:.3f}")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return result
