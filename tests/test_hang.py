"""Hang and straggler detection: the rules on synthetic heartbeats (fast); a real stopped process's stack and
`orch bench hang` end to end (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.config.schema import HangConfig
from orchestrator.controller.hang_policy import STRAGGLER_CHECKS, Beat, StragglerWatch, hang_threshold, hung, read_beats
from orchestrator.controller.hang_watch import dump_stack
from orchestrator.errors import ConfigError


def beats(now: float, ages: list[float], step_time: float = 0.05, busy: list[float] | None = None) -> list[Beat]:
    busy = busy or [step_time] * len(ages)
    return [Beat(node=i, rank=i, pid=1000 + i, t=now - age, step=10, step_t=now - age, step_time_s=step_time,
                 busy_s=b) for i, (age, b) in enumerate(zip(ages, busy))]


def test_a_silent_heartbeat_past_the_threshold_is_a_hang_and_nothing_else_is():
    cfg = HangConfig()
    now = 1000.0
    assert hang_threshold(beats(now, [0, 0]), cfg) == cfg.floor_s  # fast steps: the floor decides
    assert hang_threshold(beats(now, [0, 0], step_time=2.0), cfg) == 20.0  # slow steps: 10 x the median
    assert hung(beats(now, [0.5, 5.9]), now, cfg) == []
    (found, age), = hung(beats(now, [0.5, 7.0]), now, cfg)
    assert found.node == 1 and age == 7.0
    # Ranks waiting in a collective on the stopped one keep beating: only the silent one is named.
    assert [b.rank for b, _ in hung(beats(now, [0.2, 0.3, 30.0]), now, cfg)] == [2]


def test_a_straggler_is_named_after_consecutive_checks_with_its_ratio():
    watch = StragglerWatch(HangConfig(straggler_factor=2.0))
    slow = beats(0.0, [0, 0, 0], busy=[0.05, 0.05, 0.16])
    for _ in range(STRAGGLER_CHECKS - 1):
        assert watch.check(slow) == []
    (b, ratio), = watch.check(slow)
    assert b.rank == 2 and ratio == pytest.approx(3.2)
    assert watch.check(slow) == []  # reported once
    assert watch.check(beats(0.0, [0, 0, 0], busy=[0.05, 0.05, 0.16 / 2])) == []  # one hiccup below resets
    assert StragglerWatch(HangConfig(straggler_factor=0)).check(slow) == []


def test_hang_settings_are_checked():
    with pytest.raises(ConfigError, match="hang.floor_s"):
        HangConfig(floor_s=1.0)
    with pytest.raises(ConfigError, match="hang.straggler_factor"):
        HangConfig(straggler_factor=0.5)


HEARTBEATING = """
import sys, time
from orchestrator.elastic.heartbeat import Heartbeat
from orchestrator.runtime.distributed import DistContext
def training_loop_stuck_here():
    while True:
        time.sleep(0.05)
hb = Heartbeat(sys.argv[1], DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
               restart_count=0, node=3), 0.2)
hb.step_done(7, 0.05, 0.04)
training_loop_stuck_here()
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_stopped_workers_heartbeat_goes_silent_and_its_stack_names_where_it_was(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HEARTBEATING, str(tmp_path)])
    try:
        path = tmp_path / "heartbeats" / "node3-rank0.json"
        deadline = time.monotonic() + 30
        while not (path.exists() and json.loads(path.read_text()).get("step") == 7) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.5)
        (beat,) = read_beats(tmp_path / "heartbeats")
        assert beat.pid == proc.pid and beat.node == 3 and beat.step == 7
        time.sleep(1.0)
        assert read_beats(tmp_path / "heartbeats")[0].t == beat.t, "a stopped process writes no heartbeat"
        stack = dump_stack(tmp_path, beat)
        assert "training_loop_stuck_here" in stack, stack
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_hang_detects_a_stopped_worker_recovers_and_raises_no_false_alarm(tmp_path):
    from orchestrator.bench.hang import run_hang_bench

    r = run_hang_bench(quiet_s=10, workdir=str(tmp_path), max_steps=80)
    assert r["detected"] and r["hang_rank"] is not None and "File" in r["hang_stack_head"], r
    assert r["status"] == "succeeded" and r["steps_completed"] == 80
    assert r["recovery_s"] < 60, r  # vs backend.timeout_s (1800 s); the bench's own target here is 15 s
    assert r["false_alarms"] == 0, r
