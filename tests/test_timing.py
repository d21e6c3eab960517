"""StepTimer: phase accounting against a scripted clock, and its comm hook on a real DDP model (gloo, world 1)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.runtime.timing import NullStepTimer, StepTimer, union_seconds, with_other

pytestmark = pytest.mark.timeout(60)


class ScriptedClock:
    """Returns the times it is given, in order."""

    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_union_counts_overlapping_intervals_once():
    assert union_seconds([]) == 0.0
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)


def test_phases_split_compute_from_exposed_comm():
    # init, mark(step), lap data, [bucket launched at 0.030], lap_backward, lap optimizer, mark, lap checkpoint
    clock = ScriptedClock(0.0, 0.0, 0.002, 0.030, 0.040, 0.045, 0.045, 0.046)
    timer = StepTimer(clock=clock, inflight=False)
    timer.mark()
    timer.lap("data")
    timer._last_launch = clock()  # what comm_hook records when DDP launches the last bucket
    timer.lap_backward()
    timer.lap("optimizer")
    timer.mark()
    timer.lap("checkpoint")
    means = timer.window(steps=1)
    assert means == pytest.approx({"data_s": 0.002, "compute_s": 0.028, "comm_s": 0.010, "optimizer_s": 0.005,
                                   "checkpoint_s": 0.001})
    assert with_other(means, step_time_s=0.050)["other_s"] == pytest.approx(0.004)
    assert timer.window(steps=1) == dict.fromkeys(means, 0.0), "a window starts from zero"


def test_micro_steps_without_a_bucket_launch_are_all_compute():
    clock = ScriptedClock(0.0, 0.0, 0.010)
    timer = StepTimer(clock=clock, inflight=False)
    timer.mark()
    timer.lap_backward()  # under no_sync(): DDP launched nothing
    assert timer.window(1)["comm_s"] == 0.0


def test_comm_hook_times_real_ddp_buckets_and_keeps_the_gradients():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = []
        for timer in (NullStepTimer(), StepTimer()):
            torch.manual_seed(0)
            model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), bucket_cap_mb=1e-4)
            timer.register(model)
            timer.mark()
            model(torch.ones(4, 8)).sum().backward()
            timer.lap_backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            means = timer.window(1)
        assert all(torch.equal(a, b) for a, b in zip(*grads)), "the hook averages exactly as DDP's built-in all-reduce"
        assert means["comm_inflight_s"] > 0 and means["comm_s"] >= 0 and means["compute_s"] > 0
    finally:
        dist.destroy_process_group()
