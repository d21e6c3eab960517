"""``orch bench memory``: per-rank memory of ddp against fsdp2 on the same model at world sizes 1, 2 and 4, side
by side in one run, with throughput.

Each (strategy, world size) runs in processes of its own (``torch.multiprocessing`` spawn, gloo over a
FileStore in a temporary directory: no ports), so each peak RSS is that run's alone. The preset's model is
built through orch's strategy as the built-in trainer builds it (``Strategy.build``: under ddp every rank
builds it whole, under fsdp2 rank 0 alone and the others on the meta device, then only their shards), AdamW
goes over the wrapped module's parameters and it trains ``steps`` optimizer steps of one micro-batch. Measured
per rank, after the last ``optimizer.step()`` and before ``zero_grad`` (parameters, gradients and both Adam
moments all alive):

- ``state_bytes``: the bytes of parameters + gradients + optimizer state this rank holds (a DTensor counts its
  local shard, ``to_local()``); the unit FSDP2 gathers for a forward or backward is transient and not counted;
- ``peak_rss_bytes``: the process's peak resident set (``ru_maxrss``), which includes the interpreter and torch
  (a few hundred MB) and, on rank 0 under fsdp2, the whole model it builds and sends before sharding;
- ``samples_per_s``: global samples per second over the steps after the first.

The largest value over ranks is reported. The JSON's ``fsdp2_over_ddp_state_bytes_per_rank`` and
``fsdp2_over_ddp_peak_rss_per_rank`` hold the ratios keyed by world size (``"2"``, ``"4"``); the state targets
are at most 0.6 at 2 and 0.35 at 4.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

TARGETS = {"2": 0.6, "4": 0.35}
STRATEGIES = ("ddp", "fsdp2")


def run_memory_bench(preset: str = "cpu_fsdp", world_sizes: Sequence[int] = (1, 2, 4), steps: int = 4,
                     micro_batch: int = 2, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Rows per (world size, strategy) and the fsdp2/ddp ratios; see the module docstring."""
    import torch.multiprocessing as mp

    from orchestrator.config.compose import compose_config

    cfg = compose_config(preset, list(overrides))  # validated once here: the ranks compose the same
    rows = []
    for world in world_sizes:
        for strategy in STRATEGIES:
            with tempfile.TemporaryDirectory(prefix="orch-bench-memory-") as tmp:
                args = (world, tmp, preset, [*overrides, f"parallelism={strategy}"], steps, micro_batch)
                mp.start_processes(_rank, args=args, nprocs=world, start_method="spawn", join=True)
                ranks = [json.load(open(f"{tmp}/rank{r}.json")) for r in range(world)]
            rows.append({"world_size": world, "strategy": strategy, "params": ranks[0]["params"],
                         "state_bytes": max(r["state_bytes"] for r in ranks),
                         "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
                         "peak_rss_bytes_by_rank": [r["peak_rss_bytes"] for r in ranks],
                         "samples_per_s": ranks[0]["samples_per_s"]})
    by = {(r["world_size"], r["strategy"]): r for r in rows}
    ratios = {str(w): by[w, "fsdp2"]["state_bytes"] / by[w, "ddp"]["state_bytes"] for w in world_sizes}
    return {"preset": preset, "model": {k: v for k, v in cfg.model.items()}, "steps": steps, "micro_batch": micro_batch,
            "rows": rows, "fsdp2_over_ddp_state_bytes_per_rank": ratios,
            "fsdp2_over_ddp_peak_rss_per_rank": {
                str(w): by[w, "fsdp2"]["peak_rss_bytes"] / by[w, "ddp"]["peak_rss_bytes"] for w in world_sizes},
            "targets": {w: t for w, t in TARGETS.items() if w in ratios},
            "targets_met": {w: ratios[w] <= t for w, t in TARGETS.items() if w in ratios}}


def _rank(rank: int, world: int, tmp: str, preset: str, overrides: list[str], steps: int, micro_batch: int) -> None:
    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate

    from orchestrator.config.compose import compose_config
    from orchestrator.parallel import strategy_for
    from orchestrator.runtime.distributed import DistContext

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # world processes share the machine's cores
    # Both strategies import what either would, so a peak RSS differs by what the strategy holds, not its imports.
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world), rank=rank, world_size=world)
    try:
        cfg = compose_config(preset, overrides)
        strategy, device = strategy_for(cfg), torch.device("cpu")
        torch.manual_seed(cfg.trainer.seed)
        model = strategy.build(lambda: instantiate(cfg.model, _convert_="all"), DistContext.from_env(), device)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        vocab, seq = cfg.model["vocab_size"], cfg.model["max_seq_len"]
        g = torch.Generator().manual_seed(rank)
        start = 0.0
        for step in range(steps):
            if step == 1:
                dist.barrier()
                start = time.perf_counter()
            tokens = torch.randint(1, vocab, (micro_batch, seq), generator=g)
            model(tokens, tokens).backward()
            optim.step()
            if step < steps - 1:
                optim.zero_grad(set_to_none=True)
        dist.barrier()
        elapsed = time.perf_counter() - start
        result = {"params": sum(p.numel() for p in model.parameters()), "state_bytes": state_bytes(model, optim),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "samples_per_s": micro_batch * world * (steps - 1) / elapsed if steps > 1 else None}
    finally:
        dist.destroy_process_group()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def state_bytes(model: Any, optim: Any) -> int:
    """Bytes of this rank's parameters, their gradients and the optimizer's tensors (a DTensor: its shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    total = sum(local(p) for p in params) + sum(local(p.grad) for p in params if p.grad is not None)
    return total + sum(local(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def main_memory_bench(out: str | None, preset: str, world_sizes: Sequence[int], steps: int) -> dict[str, Any]:
    """Run :func:`run_memory_bench`, print the table and whether the targets are met, write JSON to ``out``."""
    result = run_memory_bench(preset, world_sizes, steps)
    mb = 1e6
    print(f"per-rank memory, ddp vs fsdp2, {result['rows'][0]['params'] / 1e6:.1f}M-parameter model of "
          f"conf={preset} (AdamW, fp32, {steps} steps of {result['micro_batch']} samples per rank)")
    print(f"  {'world':>5} {'strategy':<8} {'state MB/rank':>14} {'peak RSS MB':>12} {'samples/s':>10}")
    for r in result["rows"]:
        rate = f"{r['samples_per_s']:.1f}" if r["samples_per_s"] is not None else "-"
        print(f"  {r['world_size']:>5} {r['strategy']:<8} {r['state_bytes'] / mb:>14.1f} "
              f"{r['peak_rss_bytes'] / mb:>12.1f} {rate:>10}")
    for world, ratio in result["fsdp2_over_ddp_state_bytes_per_rank"].items():
        target = result["targets"].get(world)
        verdict = f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})" if target else ""
        print(f"  fsdp2/ddp state per rank at world {world}: {ratio:.3f}{verdict}; peak RSS "
              f"{result['fsdp2_over_ddp_peak_rss_per_rank'][world]:.3f}")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
