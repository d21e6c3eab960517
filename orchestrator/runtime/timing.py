"""Where each training step's time goes: data wait, compute, gradient communication, optimizer, checkpoint.

The loop marks phase boundaries with :class:`StepTimer` (host wall clock, ``time.perf_counter``), and the
timer's DDP comm hook marks when each gradient bucket is handed to all-reduce. What each field measures,
per optimizer step:

- ``data_s``: blocked in ``next(loader)``, every micro-batch of the step.
- ``compute_s``: forward + backward of every micro-batch, minus ``comm_s``.
- ``comm_s``: *exposed* gradient communication. DDP launches a bucket's all-reduce as soon as its gradients
  are ready, and ``backward()`` returns only once every bucket's future has completed; so the time from the
  launch of the step's last bucket to the return of ``backward()`` is communication that compute did not
  hide (plus copying the reduced buckets into ``.grad``: microseconds).
- ``comm_inflight_s``: wall time during which at least one bucket's all-reduce was in flight, from its
  launch to its future's completion (a ``then`` callback on the future); overlaps backward compute. Host
  clock, so only on CPU: on CUDA a future completes when the work is enqueued, not done, and it is omitted.
- ``optimizer_s``: unscale, gradient clipping, optimizer step, scaler update, LR scheduler, ``zero_grad``.
- ``checkpoint_s``: the loop blocked by a periodic checkpoint save (state snapshot, RNG gather; an async
  save's write overlaps the following steps and is not counted).
- ``other_s`` (filled in by the caller from the step time): everything else, e.g. the preemption agreement
  (one small all-reduce per step), metrics logging, Python loop overhead.

On CUDA kernels run asynchronously, so host-side phases show where the host *waited*: GPU work lands in the
phase that first synchronizes with it. The breakdown is exact on CPU, indicative on GPU.

Cost: a handful of ``perf_counter`` calls per step and one Python callback per bucket; ``orch bench
overhead`` measures it (``timing_overhead``).

Start-up is timed too, once per worker process, by :class:`StartupTimes`: unix times (``time.time``) at
which each phase of a worker's start ended, from its torchrun agent's start to the first step. Rank 0 writes
their latest value over all ranks as one ``worker_started`` event per attempt; goodput
(``orchestrator/report/goodput.py``) splits the time between an interruption and the next first step by them.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # torch is imported where it is used: reports read PHASES without loading torch
    import torch

PHASES = ("data", "compute", "comm", "optimizer", "checkpoint")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class StepTimer:
    """Accumulates phase times over a log window; :meth:`window` returns per-step means and starts anew.

    The loop calls :meth:`mark` where a phase starts, :meth:`lap` where it ends, :meth:`lap_backward` after
    ``backward()`` (splitting compute from exposed communication); :meth:`register` installs the comm hook.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, inflight: bool = True):
        self._clock = clock
        self._inflight_enabled = inflight
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._intervals: list[tuple[float, float]] = []
        self._last = clock()
        self._last_launch: Optional[float] = None
        self.comm_seconds = 0.0  # exposed communication since the start (a step's busy time is the rest)

    def register(self, ddp: "torch.nn.parallel.DistributedDataParallel", hook: Optional[Callable] = None) -> None:
        """Time the all-reduce of every gradient bucket of ``ddp``: ``hook``'s (a DDP comm hook), else torch's
        default allreduce, wrapped."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._allreduce = hook or allreduce_hook
        ddp.register_comm_hook(None, self.comm_hook)

    def comm_hook(self, process_group, bucket):  # no annotations: DDP rejects the string ones of this module
        """torch's ``allreduce_hook`` (what DDP does without a hook; or the hook :meth:`register` was given), plus
        the launch and completion times.

        ``process_group``: DDP's hook state (None: the default group); ``bucket``: a ``dist.GradBucket``.
        Returns the future of the averaged bucket, as DDP requires."""
        start = self._clock()
        self._last_launch = start
        future = self._allreduce(process_group, bucket)
        if not self._inflight_enabled:
            return future

        def completed(fut: "torch.futures.Future[torch.Tensor]") -> "torch.Tensor":
            self._intervals.append((start, self._clock()))  # list.append: atomic, from the comm thread
            return fut.value()

        return future.then(completed)

    def mark(self) -> None:
        """A phase starts now."""
        self._last = self._clock()

    def lap(self, phase: str) -> None:
        """``phase`` ended now: add the time since the previous mark or lap to it."""
        now = self._clock()
        self._totals[phase] += now - self._last
        self._last = now

    def lap_backward(self) -> None:
        """A forward + backward ended now: compute, except what followed the last bucket launch (comm)."""
        now = self._clock()
        launched = self._last_launch
        exposed = now - launched if launched is not None and launched >= self._last else 0.0
        self._totals["comm"] += exposed
        self.comm_seconds += exposed
        self._totals["compute"] += now - self._last - exposed
        self._last, self._last_launch = now, None

    def window(self, steps: int) -> dict[str, float]:
        """Mean seconds per step of each phase since the previous window (``{phase}_s``); resets."""
        means = {f"{phase}_s": total / steps for phase, total in self._totals.items()}
        if self._inflight_enabled:
            means["comm_inflight_s"] = union_seconds(self._intervals) / steps
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._intervals = []
        return means


class NullStepTimer(StepTimer):
    """Measures nothing and installs no hook: DDP keeps its built-in C++ all-reduce (the untimed baseline)."""

    def __init__(self) -> None:
        self.comm_seconds = 0.0

    def register(self, ddp, hook: Optional[Callable] = None) -> None:
        if hook is not None:  # a hook that does work (a fault-tolerance mode's cross-group average) still runs, untimed
            ddp.register_comm_hook(None, hook)

    def mark(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def lap_backward(self) -> None:
        pass

    def window(self, steps: int) -> dict[str, float]:
        return {}


def with_other(means: dict[str, float], step_time_s: float) -> dict[str, float]:
    """``means`` plus ``other_s``: the part of ``step_time_s`` no phase accounts for (never negative)."""
    measured = sum(means.get(f"{phase}_s", 0.0) for phase in PHASES)
    return {**means, "other_s": max(0.0, step_time_s - measured)}


def timer_for(device: "torch.device") -> StepTimer:
    """The step timer of a trainer on ``device`` (in-flight comm times only where the host clock sees them)."""
    return StepTimer(inflight=device.type == "cpu")


STARTUP_MILESTONES = ("agent_start", "process_start", "entry", "imports", "config", "process_group", "model",
                      "restore", "ready")
"""A worker's start-up, in order; ``StartupTimes`` records ``<milestone>_t`` for each:

- ``agent_start``: its torchrun agent process started (under torchrun only).
- ``process_start``: the worker process started (torchrun spawns workers when its rendezvous round is done).
- ``entry``: the entry module began to run, before its heavy imports (the interpreter is up).
- ``imports``: torch, hydra and orch are imported.
- ``config``: the run's config is loaded.
- ``process_group``: the process group is initialized (every rank has joined it).
- ``model``: model, DDP wrapper, optimizer and dataset are built.
- ``restore``: the checkpoint to resume from is loaded (or none was found).
- ``ready``: the data loader is built; the first step starts next.
"""


def process_start_time(pid: Optional[int] = None) -> Optional[float]:
    """Unix time at which process ``pid`` (default: this one) started; None if it cannot be told.

    On Linux from /proc: the start tick against /proc/uptime, to ~10 ms (psutil's ``create_time`` adds the
    boot time, which /proc/stat rounds to whole seconds). Elsewhere psutil's ``create_time``."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22; the fields after ")" start at 3
        with open("/proc/uptime") as f:
            uptime, now = float(f.read().split()[0]), time.time()
        return now - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return psutil.Process(pid).create_time()
        except Exception:  # no such process, no psutil, no permission: the time is simply unknown
            return None


class StartupTimes:
    """When each phase of this worker's start-up ended (:data:`STARTUP_MILESTONES`), in unix seconds.

    Created at the top of the worker's ``main`` (it reads the agent's and its own process start times then);
    ``entry_t`` is the time the entry module started, taken before its heavy imports. :meth:`mark` records a
    milestone now; :meth:`fields` returns ``{"<milestone>_t": t}`` for those known."""

    def __init__(self, entry_t: Optional[float] = None, clock: Callable[[], float] = time.time):
        self._clock = clock
        self.times: dict[str, float] = {}
        if "TORCHELASTIC_RUN_ID" in os.environ:  # the parent is torchrun's agent only under torchrun
            self._known("agent_start", process_start_time(os.getppid()))
        self._known("process_start", process_start_time())
        self._known("entry", entry_t)

    def _known(self, milestone: str, t: Optional[float]) -> None:
        if t is not None:
            self.times[f"{milestone}_t"] = t

    def mark(self, milestone: str) -> None:
        """``milestone`` (one of :data:`STARTUP_MILESTONES`) ended now."""
        if milestone not in STARTUP_MILESTONES:
            raise ValueError(f"unknown start-up milestone {milestone!r}; known: {', '.join(STARTUP_MILESTONES)}")
        self.times[f"{milestone}_t"] = self._clock()

    def fields(self) -> dict[str, float]:
        return dict(self.times)


def latest_over_ranks(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Each milestone's latest time over ranks: a phase is over for the job when its slowest rank is done."""
    latest: dict[str, float] = {}
    for times in per_rank:
        for key, t in (times or {}).items():
            if key.endswith("_t") and isinstance(t, (int, float)):
                latest[key] = max(t, latest.get(key, t))
    return latest
