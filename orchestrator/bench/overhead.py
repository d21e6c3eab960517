"""``orch bench overhead [--out FILE.json]``: orch's own cost, against a plain torchrun script of the same job.

Two measurements:

1. **orch vs plain torchrun.** The same DDP job (``conf=cpu_gloo`` on one node with 2 processes: model,
   data, batch, optimizer, schedule, clipping) run by ``orchestrator/bench/plain_ddp.py`` under a bare
   ``torchrun --standalone`` and by ``orch launch``, alternating (plain, orch, orch, plain, ...) so machine
   noise hits both alike. Both note the wall clock on rank 0 at the same logged steps (every 5); a run's
   throughput is the median samples/s of its windows after step ``warmup_steps`` (a burst of load from
   other processes moves a median less than a mean), and each side's number is the median over
   ``repeats`` runs. ``first_step`` is the time from starting the command to the end of step 1 (orch:
   composing the config, the store, the agents; both: torchrun, imports, rendezvous). Ratios are
   orch / plain: throughput_ratio 1.0 = no overhead; first_step_ratio > 1 = orch starts slower.
2. **The per-step timing's own cost.** ``timing_overhead`` = (the timer's phase calls, timed in a tight
   loop, + per DDP bucket what the timer's comm hook adds: its whole path (torch's Python
   ``allreduce_hook``, the timing, the future callbacks) minus the same all-reduce issued bare, on a
   1-element bucket at world size 1, in alternating batches) / the median step time of the trainer's model.
   ``timing_overhead_ab`` is the end-to-end check: in this process (world size 1, gloo) the same model
   trains with and without the StepTimer, steps alternating; the median paired difference over the median
   untimed step. It is as noisy as the machine (its IQR is reported with it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from orchestrator.config.compose import compose_config
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, EventName, read_jsonl

PRESET = "cpu_gloo"
SHAPE = ("cluster.nnodes=1", "cluster.nproc_per_node=2")  # one torchrun agent with 2 workers, like the plain run
PLAIN_SCRIPT = Path(__file__).with_name("plain_ddp.py")


def window_throughputs(marks: dict[int, float], global_batch: int, warmup_steps: int) -> list[float]:
    """Samples/s of each window between consecutive marks after step ``warmup_steps`` (``marks``: step -> unix
    time at the end of that step)."""
    steps = sorted(s for s in marks if s >= warmup_steps)
    return [global_batch * (b - a) / (marks[b] - marks[a]) for a, b in zip(steps, steps[1:])]


def run_plain(cfg, steps: int, log_every: int, workdir: Path) -> dict[str, float]:
    out = workdir / "plain.json"
    model = {k: v for k, v in cfg.model.items() if k != "_target_"}
    data = {k: v for k, v in cfg.data.dataset.items() if k != "_target_"}
    from orchestrator.parallel.ddp import ddp_kwargs

    ddp = ddp_kwargs(cfg.ddp)  # the trainer's DDP flags (its ddp strategy's)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(PLAIN_SCRIPT),
            f"--steps={steps}", f"--global-batch={cfg.trainer.global_batch_size}",
            f"--micro-batch={cfg.trainer.micro_batch_size}", f"--log-every={log_every}", f"--lr={cfg.optim['lr']}",
            f"--model={json.dumps(model)}", f"--data={json.dumps(data)}", f"--ddp={json.dumps(ddp)}", f"--out={out}"]
    start = time.time()
    _run(argv, workdir / "plain.log", {"OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    return {"start_t": start, "first_step_t": result["first_step_t"],
            "marks": {int(k): v for k, v in result["log_t"].items()}}


def run_orch(steps: int, log_every: int, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / "orch"
    argv = [sys.executable, "-m", "orchestrator.cli", "launch", f"conf={PRESET}", *SHAPE, *_orch_overrides(steps, log_every),
            f"run.dir={run_dir}"]
    start = time.time()
    _run(argv, workdir / "orch.log", {})
    first = next(e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == EventName.FIRST_STEP)
    return {"start_t": start, "first_step_t": first["t"],
            "marks": {m["step"]: m["t"] for m in read_jsonl(run_dir / METRICS_FILE)}}


def _orch_overrides(steps: int, log_every: int) -> list[str]:
    return ["launcher=local", f"trainer.max_steps={steps}", f"trainer.log_every={log_every}",
            "checkpoint.every_n_steps=0"]


def _run(argv: list[str], log: Path, env: dict[str, str]) -> None:
    with log.open("w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=600).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {rc}; see {log}:\n{log.read_text()[-2000:]}")


def compare_with_plain(repeats: int, steps: int, warmup_steps: int, log_every: int, echo=print) -> dict[str, Any]:
    """Alternate plain and orch runs; medians of throughput and time to first step, and their ratios."""
    cfg = compose_config(PRESET, [*SHAPE, *_orch_overrides(steps, log_every)])
    samples = {"plain": [], "orch": []}
    with tempfile.TemporaryDirectory(prefix="orch-bench-overhead-") as tmp:
        for i in range(repeats):
            for kind in (("plain", "orch") if i % 2 == 0 else ("orch", "plain")):
                workdir = Path(tmp) / f"{kind}{i}"
                workdir.mkdir()
                r = run_plain(cfg, steps, log_every, workdir) if kind == "plain" else run_orch(steps, log_every, workdir)
                # The median window: a burst of load from other processes moves it less than the mean.
                tput = statistics.median(window_throughputs(r["marks"], cfg.trainer.global_batch_size, warmup_steps))
                samples[kind].append({"samples_per_s": tput, "first_step_s": r["first_step_t"] - r["start_t"]})
                echo(f"  {kind:<5} run {i + 1}/{repeats}: {tput:8.1f} samples/s, first step after "
                     f"{r['first_step_t'] - r['start_t']:5.2f} s")
    med = {kind: {key: statistics.median(s[key] for s in runs) for key in ("samples_per_s", "first_step_s")}
           for kind, runs in samples.items()}
    return {"throughput_ratio": med["orch"]["samples_per_s"] / med["plain"]["samples_per_s"],
            "first_step_ratio": med["orch"]["first_step_s"] / med["plain"]["first_step_s"],
            "plain": med["plain"], "orch": med["orch"], "runs": samples}


def measure_timing_cost(steps: int = 300, warmup: int = 20) -> dict[str, Any]:
    """The StepTimer's cost on the trainer's model, in this process (world size 1): see the module docstring."""
    import torch
    import torch.distributed as dist

    cfg = compose_config(PRESET, ["cluster.nnodes=1"])
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pairs, buckets = _paired_steps(cfg, steps, warmup)
        hook_s, bare_s = hook_path_cost()
    finally:
        if own_group:
            dist.destroy_process_group()
    untimed = statistics.median(u for u, _ in pairs)
    diffs = sorted(t - u for u, t in pairs)
    calls_s = timer_calls_cost()
    added_s = calls_s + buckets * max(0.0, hook_s - bare_s)
    return {"timing_overhead": added_s / untimed,
            "timing_cost_us_per_step": added_s * 1e6, "timer_calls_us_per_step": calls_s * 1e6,
            "comm_hook_added_us_per_bucket": (hook_s - bare_s) * 1e6, "comm_hook_path_us": hook_s * 1e6,
            "bare_allreduce_us": bare_s * 1e6, "buckets": buckets,
            "untimed_step_s": untimed, "timed_step_s": statistics.median(t for _, t in pairs),
            "timing_overhead_ab": statistics.median(diffs) / untimed,
            "timing_overhead_ab_iqr": [diffs[len(diffs) // 4] / untimed, diffs[3 * len(diffs) // 4] / untimed]}


def _paired_steps(cfg, steps: int, warmup: int) -> tuple[list[tuple[float, float]], int]:
    """(untimed, timed) seconds of ``steps`` alternating training steps, and the number of DDP buckets."""
    import torch
    from hydra.utils import instantiate
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from orchestrator.runtime.timing import NullStepTimer, StepTimer

    loader = DataLoader(instantiate(cfg.data.dataset, _convert_="all"), batch_size=cfg.trainer.micro_batch_size)
    batch_list = [b for _, b in zip(range(16), loader)]
    arms = {}
    for name, timer in (("untimed", NullStepTimer()), ("timed", StepTimer())):
        torch.manual_seed(0)
        model = DDP(instantiate(cfg.model, _convert_="all"))
        timer.register(model)
        arms[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), timer)

    def step(name: str, i: int) -> float:  # the trainer's step, with its timer calls in the same places
        model, optimizer, timer = arms[name]
        start = time.perf_counter()
        timer.mark()
        batch = batch_list[i % len(batch_list)]
        timer.lap("data")
        model(batch["input_ids"], batch["labels"]).backward()
        timer.lap_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.lap("optimizer")
        timer.mark()
        timer.lap("checkpoint")
        if i % 5 == 4:
            timer.window(5)
        return time.perf_counter() - start

    for i in range(warmup):
        step("untimed", i), step("timed", i)
    pairs = []
    for i in range(steps):
        order = ("untimed", "timed") if i % 2 == 0 else ("timed", "untimed")
        t = {name: step(name, i) for name in order}
        pairs.append((t["untimed"], t["timed"]))
    buckets = len(arms["timed"][0]._get_ddp_logging_data().get("bucket_sizes", "1").split(","))
    return pairs, buckets


def hook_path_cost(n: int = 3000, batches: int = 10) -> tuple[float, float]:
    """Seconds per bucket of (the timer's comm hook path, the same all-reduce without it), on a 1-element bucket
    at world size 1, in alternating batches; the difference is what the hook adds.

    The hook path is torch's Python ``allreduce_hook`` (divide, all-reduce, a ``then`` callback) plus the
    timing (a clock read, a second callback). Both paths hand the all-reduce to gloo's thread and wait for
    it, so scheduling delays on a busy machine hit both; the bare path issues the all-reduce from Python,
    which DDP's built-in C++ path does not (a few us, not subtracted).
    """
    import torch
    import torch.distributed as dist

    from orchestrator.runtime.timing import StepTimer

    class _Bucket:  # allreduce_hook only asks a GradBucket for its buffer
        def __init__(self) -> None:
            self.tensor = torch.zeros(1)

        def buffer(self) -> torch.Tensor:
            return self.tensor

    timer, bucket = StepTimer(), _Bucket()
    timer.register(_NoDDP())

    def hooked() -> None:
        timer.comm_hook(None, bucket).wait()

    def bare() -> None:
        bucket.tensor.div_(1)
        dist.all_reduce(bucket.tensor, async_op=True).get_future().wait()

    per_call: dict[str, list[float]] = {"hooked": [], "bare": []}
    for k in range(batches):
        for name, fn in ((("hooked", hooked), ("bare", bare)) if k % 2 == 0 else (("bare", bare), ("hooked", hooked))):
            start = time.perf_counter()
            for _ in range(n // batches):
                fn()
            per_call[name].append((time.perf_counter() - start) / (n // batches))
        timer.window(1)
    return statistics.median(per_call["hooked"]), statistics.median(per_call["bare"])


class _NoDDP:
    """Takes the timer's comm hook registration, so the hook can run outside a DDP model."""

    def register_comm_hook(self, state, hook) -> None:
        pass


def timer_calls_cost(n: int = 20000) -> float:
    """Seconds per step of the StepTimer's phase calls alone (no training work, no comm hook)."""
    from orchestrator.runtime.timing import StepTimer

    timer = StepTimer(inflight=False)
    start = time.perf_counter()
    for i in range(n):
        timer.mark()
        timer.lap("data")
        timer.lap_backward()
        timer.lap("optimizer")
        timer.mark()
        timer.lap("checkpoint")
        if i % 5 == 4:
            timer.window(5)
    return (time.perf_counter() - start) / n


def main_overhead_bench(out: Optional[str], repeats: int = 4, steps: int = 150, warmup_steps: int = 20,
                        log_every: int = 5, timing_steps: int = 300) -> dict[str, Any]:
    """The ``orch bench overhead`` command: run both measurements, print them, write the JSON."""
    print(f"orch vs plain torchrun: {PRESET}, 1 node x 2 processes, {steps} steps, throughput after step "
          f"{warmup_steps}, {repeats} runs each, alternating")
    result = compare_with_plain(repeats, steps, warmup_steps, log_every)
    print(f"timing cost: {timing_steps} alternating steps with and without the StepTimer (world size 1)")
    result.update(measure_timing_cost(timing_steps))
    result.update({"preset": PRESET, "shape": list(SHAPE), "steps": steps, "warmup_steps": warmup_steps,
                   "repeats": repeats})
    print(f"  throughput_ratio (orch / plain)  {result['throughput_ratio']:.3f}   target >= 0.97   "
          f"(median {result['orch']['samples_per_s']:.1f} vs {result['plain']['samples_per_s']:.1f} samples/s)")
    print(f"  first_step_ratio (orch / plain)  {result['first_step_ratio']:.3f}   "
          f"(median {result['orch']['first_step_s']:.2f} vs {result['plain']['first_step_s']:.2f} s)")
    lo, hi = result["timing_overhead_ab_iqr"]
    print(f"  timing_overhead                  {result['timing_overhead']:.3%}   target < 1%   "
          f"({result['timing_cost_us_per_step']:.1f} us per {1e3 * result['untimed_step_s']:.1f} ms step: timer calls "
          f"{result['timer_calls_us_per_step']:.1f} us + {result['buckets']} bucket(s) x "
          f"{result['comm_hook_added_us_per_bucket']:.1f} us comm hook: {result['comm_hook_path_us']:.1f} us vs "
          f"{result['bare_allreduce_us']:.1f} us for the bare all-reduce)")
    print(f"  timing_overhead_ab               {result['timing_overhead_ab']:+.2%}   (end to end, paired, "
          f"IQR {lo:+.2%} .. {hi:+.2%}: machine noise)")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
