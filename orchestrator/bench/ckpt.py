"""``orch bench ckpt``: training stall of a synchronous vs an asynchronous checkpoint save, side by side.

The stall is what the training loop feels: the time ``CheckpointManager.save`` blocks. Sync and async
saves alternate inside one run on the same model and disk, so machine noise hits both alike; each number
is the median over ``repeats``. The async manager's ``wait()`` runs outside the measured stall (in a real
loop the write overlaps the next training steps).
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
    afterwards. Returns ``{"sync_stall_s", "async_stall_s", "ratio" (async/sync), "state_mb"}``.
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
        sync_stalls, async_stalls = [], []
        for i in range(repeats):
            _train_step(model, optim)
            sync_stalls.append(sync_mgr.save(i, {"model": model.state_dict(), "optim": optim.state_dict()}, {}))
            _train_step(model, optim)
            async_stalls.append(async_mgr.save(i, {"model": model.state_dict(), "optim": optim.state_dict()}, {}))
            async_mgr.wait()  # outside the stall: a real loop keeps training while the write runs
    sync_s, async_s = statistics.median(sync_stalls), statistics.median(async_stalls)
    return {
        "sync_stall_s": sync_s,
        "async_stall_s": async_s,
        "ratio": async_s / sync_s if sync_s > 0 else float("nan"),
        "state_mb": state_mb,
    }


def main_ckpt_bench(out: str | None, size_mb: float) -> dict:
    """Run :func:`run_ckpt_bench`, print a small table, write the result as JSON to ``out`` if given."""
    result = run_ckpt_bench(size_mb=size_mb)
    print(f"checkpoint save stall, {result['state_mb']:.1f} MB model+AdamW state (median of 3)")
    print(f"  {'mode':<6} {'stall':>10}")
    print(f"  {'sync':<6} {result['sync_stall_s'] * 1e3:>8.1f}ms")
    print(f"  {'async':<6} {result['async_stall_s'] * 1e3:>8.1f}ms")
    print(f"  async/sync = {result['ratio']:.3f} (target <= 0.1)")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return result
