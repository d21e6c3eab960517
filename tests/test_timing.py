"""StepTimer: phase accounting against a scripted clock, and its comm hook on a real DDP model (gloo, world 1);
StartupTimes: the start-up milestones a worker reports as ``worker_started``."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from orchestrator.runtime.timing import (STARTUP_MILESTONES, NullStepTimer, StartupTimes, StepTimer,
                                        latest_over_ranks, process_start_time, union_seconds, with_other)

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


# -- start-up milestones (what goodput splits a recovery by) ------------------------------------------------

def test_startup_times_mark_milestones_on_their_clock(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    startup = StartupTimes(entry_t=5.0, clock=ScriptedClock(6.0, 7.0))
    startup.mark("imports")
    startup.mark("process_group")
    fields = startup.fields()
    assert "agent_start_t" not in fields, "outside torchrun the parent is no agent"
    assert {k: fields[k] for k in ("entry_t", "imports_t", "process_group_t")} == {
        "entry_t": 5.0, "imports_t": 6.0, "process_group_t": 7.0}
    assert fields["process_start_t"] <= time.time()
    with pytest.raises(ValueError, match="unknown start-up milestone 'compile'"):
        startup.mark("compile")


def test_under_torchrun_the_agent_is_the_parent(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    assert StartupTimes().fields()["agent_start_t"] == pytest.approx(process_start_time(os.getppid()), abs=0.05)


@pytest.mark.slow
def test_process_start_time_is_accurate_to_a_tick():
    from orchestrator.processes import kill_tree

    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_start_time(proc.pid)
        assert before - 0.05 <= started <= time.time() + 0.05
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=10)
    assert process_start_time(proc.pid) is None


def test_latest_over_ranks_takes_each_milestones_slowest_rank():
    assert latest_over_ranks([{"model_t": 3.0, "imports_t": 1.0}, {"model_t": 4.0}, None, {"rank": 7}]) == {
        "model_t": 4.0, "imports_t": 1.0}


def test_the_trainer_reports_its_start_up_before_the_first_step(tmp_path, monkeypatch):
    """In-process, world 1: ``worker_started`` holds every milestone, in order, before ``first_step``."""
    import torch.distributed as dist

    from orchestrator.config.compose import compose_config
    from orchestrator.elastic import Session
    from orchestrator.rundir import EventLog
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.trainer.trainer import Trainer

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    cfg = compose_config("cpu_gloo", ["trainer.max_steps=2", "trainer.log_every=1", "preemption.sources=[]",
                                      f"run.dir={tmp_path}", "model.hidden_size=32", "model.num_layers=1"])
    startup = StartupTimes(entry_t=time.time())
    for milestone in ("imports", "config"):
        startup.mark(milestone)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        startup.mark("process_group")
        events = EventLog(tmp_path)
        session = Session(cfg, DistContext(0, 1, 0, 1, 0, 0), str(tmp_path), step_timer=True, startup=startup)
        Trainer(session).fit()
    finally:
        dist.destroy_process_group()
    names = [e["event"] for e in events.read()]
    assert names.index("worker_started") < names.index("first_step")
    started = next(e for e in events.read() if e["event"] == "worker_started")
    times = [started[f"{m}_t"] for m in STARTUP_MILESTONES]
    assert times == sorted(times), started
    assert started["world_size"] == 1 and started["step"] == 0


@pytest.mark.slow  # inductor builds C++ kernels on a cold cache: tens of seconds
@pytest.mark.timeout(300)
def test_trainer_compile_compiles_the_ddp_wrapped_model_and_trains(tmp_path, monkeypatch):
    """trainer.compile: torch.compile around DDP (not DDP around a compiled model), and it trains on CPU."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrator.config.compose import compose_config
    from orchestrator.elastic import Session
    from orchestrator.rundir import read_jsonl
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.trainer.trainer import Trainer

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    cfg = compose_config("cpu_gloo", ["trainer.max_steps=3", "trainer.log_every=1", "preemption.sources=[]",
                                      "trainer.compile=true", f"run.dir={tmp_path}", "model.hidden_size=32",
                                      "model.num_layers=1"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(Session(cfg, DistContext(0, 1, 0, 1, 0, 0), str(tmp_path)))
        assert isinstance(trainer.model, torch._dynamo.eval_frame.OptimizedModule)
        assert isinstance(trainer.model._orig_mod, DDP) and trainer.model._orig_mod.module is trainer.raw_model
        trainer.fit()
    finally:
        dist.destroy_process_group()
    losses = [m["loss"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
