"""The goodput simulator (orchestrator/simulate/), the checkpoint-interval policy (checkpoint.every_n_steps=auto)
and its sweep, `orch advise checkpoint`; one real preempted run with every_n_steps=auto calibrates the
simulator, which must predict that run's goodput within 10%."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import orchestrator.elastic as elastic
from orchestrator.bench import ckpt_interval
from orchestrator.bench.goodput import JOB
from orchestrator.checkpoint.interval import (IntervalPolicy, expected_mtbf_s, interval_steps, lossy_interruptions,
                                              young_daly_interval_s)
from orchestrator.cli import main
from orchestrator.report.goodput import CATEGORIES
from orchestrator.rundir import EVENTS_FILE, append_jsonl, read_jsonl
from orchestrator.runtime.distributed import DistContext
from orchestrator.simulate.model import BADPUT, JobCosts, Scenario, simulate
from orchestrator.simulate.scenario import per_step_costs
from orchestrator.simulate.trace import Interruptions, read_trace, write_trace
from orchproc import orch_here, preempt_midrun, run_orch

COSTS = JobCosts(step_s=1.0, stall_s=2.0, emergency_save_s=3.0, launch={"launch_s": 10.0, "worker_start_s": 5.0},
                 recovery={"failure": {"rendezvous_s": 4.0, "worker_start_s": 6.0, "restore_s": 1.0},
                           "preemption": {"waiting_for_nodes_s": 2.0, "rendezvous_s": 4.0}},
                 shutdown_s=7.0)


def one(t: float, preemption: bool) -> Interruptions:
    return Interruptions(np.array([t]), np.array([preemption]))


def check_partition(result: dict) -> None:
    assert result["productive_s"] + sum(result["badput"].values()) == pytest.approx(result["wall_s"])


@pytest.mark.timeout(10)
def test_young_daly_and_the_rate_estimate():
    assert young_daly_interval_s(1.0, 1e6) == pytest.approx(math.sqrt(2e6), rel=0.01)  # Young when C << M
    assert young_daly_interval_s(30.0, 10.0) == 10.0  # a save costing more than 2 M: one M of work
    assert interval_steps(0.5, 1.0, 1e6) == round(young_daly_interval_s(1.0, 1e6) / 0.5)
    assert interval_steps(10.0, 0.0, 100.0) == 1  # a free save: every step
    assert expected_mtbf_s(3600.0, 1.0, 0.0, 0) == 3600.0  # the prior alone
    assert expected_mtbf_s(3600.0, 0.25, 10_000.0, 100) == pytest.approx((900 + 10_000) / 100.25)  # the data take over
    np.testing.assert_allclose(interval_steps(1.0, 1.0, np.array([50.0, 5000.0])), [9, 99])


@pytest.mark.timeout(10)
def test_a_job_without_interruptions_costs_exactly_launch_stalls_and_shutdown():
    result = simulate(Scenario(COSTS, every_n_steps=10, steps=100))
    assert result["seeds"] == 20 and result["interruptions"] == 0
    # 100 steps, a save after steps 10..90 (the 100th is the final save, in shutdown), launch 15 s, shutdown 7 s
    assert result["wall_s"] == pytest.approx(100 + 9 * 2.0 + 15 + 7)
    assert result["goodput"] == pytest.approx(100 / result["wall_s"])
    assert result["badput"]["checkpoint_stall_s"] == pytest.approx(18.0)
    assert result["effective_training_time"] == pytest.approx(118 / result["wall_s"])
    check_partition(result)


@pytest.mark.timeout(10)
def test_a_failure_loses_the_work_since_the_last_save_and_a_notice_keeps_it():
    # Launch ends at 15 s; saves every 10 steps take 12 s a segment: at 15 + 36 + 7 = 58 s, 7 steps are unsaved.
    failed = simulate(Scenario(COSTS, every_n_steps=10, steps=100, trace=one(58.0, False)))
    assert failed["lost_steps"] == 7 and failed["badput"]["lost_s"] == pytest.approx(7.0)
    assert failed["badput"]["restore_s"] == 1.0 and failed["badput"]["rendezvous_s"] == 4.0
    assert failed["wall_s"] == pytest.approx(58 + 11 + (100 - 30) + 6 * 2.0 + 7)  # recovery 11 s, 70 steps left
    check_partition(failed)
    noticed = simulate(Scenario(COSTS, every_n_steps=10, steps=100, trace=one(58.0, True), notice_s=30))
    assert noticed["lost_steps"] == 0 and noticed["badput"]["lost_s"] == 0
    assert noticed["badput"]["checkpoint_stall_s"] == pytest.approx(9 * 2.0 + 3.0)  # + the emergency save
    assert noticed["badput"]["waiting_for_nodes_s"] == 2.0
    check_partition(noticed)
    short = simulate(Scenario(COSTS, every_n_steps=10, steps=100, trace=one(58.0, True), notice_s=1))
    assert short["lost_steps"] == 7, "a notice shorter than the emergency save is a failure"


@pytest.mark.timeout(10)
def test_an_interruption_during_recovery_starts_a_new_one_and_days_end_the_job():
    trace = Interruptions(np.array([100.0, 105.0]), np.array([False, False]))
    result = simulate(Scenario(COSTS, every_n_steps=0, days=1.0, trace=trace))
    assert result["wall_s"] == 86400.0 and result["interruptions"] == 2
    assert result["badput"]["rendezvous_s"] == 8.0 and result["badput"]["worker_start_s"] == 5 + 1 + 6
    assert result["badput"]["restore_s"] == 1.0  # only the second recovery got that far
    assert result["badput"]["lost_s"] == 85.0  # never saved: all 85 s of the first window
    check_partition(result)


@pytest.mark.timeout(10)
def test_per_step_mode_loses_only_the_step_in_flight_and_never_restarts():
    costs = per_step_costs(COSTS, heartbeat_timeout_s=10.0, quorum_s=1.0)
    result = simulate(Scenario(costs, every_n_steps=0, steps=100, trace=one(58.5, False)))
    assert result["lost_steps"] == 0 and result["badput"]["lost_s"] == pytest.approx(0.5)
    assert result["badput"]["rendezvous_s"] == 10.0 and result["badput"]["restore_s"] == 0.0
    assert result["wall_s"] == pytest.approx(15 + 100 + 0.5 + 10 + 7)
    check_partition(result)


@pytest.mark.timeout(60)
def test_llama3_scale_in_seconds_with_every_badput_category(tmp_path, capsys):
    out = tmp_path / "llama3.json"
    started = time.monotonic()
    done = orch_here(capsys, "simulate", "--nodes", "16384", "--days", "54", "--interruptions", "466",
                     "--notice-fraction", "0.1", "--step-s", "10", "--ckpt-stall-s", "30", "--rendezvous-s", "120",
                     "--worker-start-s", "300", "--restore-s", "120", f"--out={out}")
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert time.monotonic() - started < 60
    assert set(data["badput"]) == {f"{c}_s" for c in CATEGORIES} == set(BADPUT)
    assert 0.5 < data["goodput"] < 1 and data["goodput_ci95"][0] <= data["goodput"] <= data["goodput_ci95"][1]
    assert 400 < data["interruptions"] < 540 and data["seeds"] == 20 and data["lost_steps"] > 0
    assert data["wall_s"] == 54 * 86400 and data["effective_training_time"] > data["goodput"]
    assert "goodput" in done.stdout and "effective training time" in done.stdout
    helped = orch_here(capsys, "simulate", "--help").stdout  # argparse %-formats help, not the description
    assert "95% intervals over seeds" in helped and "%%" not in helped


@pytest.mark.timeout(60)
def test_a_trace_replays_and_bad_input_is_one_line(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    write_trace(str(trace), Interruptions(np.array([58.0, 3000.0]), np.array([False, True])), nodes=[3, 1])
    assert trace.read_text().splitlines()[:2] == ["time,node,kind", "58.0,3,failure"]
    read = read_trace(str(trace), nodes=4)
    assert read.t.tolist() == [58.0, 3000.0] and read.preemption.tolist() == [False, True]
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--nodes", "4", "--steps", "100", "--every-n-steps", "10",
                 "--step-s", "1", "--ckpt-stall-s", "2", f"--out={out}"]) == 0
    # no launch cost: at 58 s, 4 segments of 10 steps + a 2 s save are behind, the 10 steps after them are lost
    assert json.loads(out.read_text())["lost_steps"] == 10
    trace.write_text("time,node,kind\n10,0,meteor\n")
    capsys.readouterr()
    for key, args in (("--trace", [str(trace)]), ("--days", ["0"]), ("--interruptions", ["5"]),
                      ("--every-n-steps", ["often"]), ("--trace", [str(trace), "--mtbf-h", "3"]),
                      ("--calibrate", [str(tmp_path)])):
        assert main(["simulate", key, *args]) == 2
        printed = capsys.readouterr()
        line = printed.err.strip()
        assert printed.out == "" and "\n" not in line and f"{key}=" in line and "Fix:" in line, line


@pytest.mark.timeout(60)
def test_auto_is_within_one_percent_of_the_best_fixed_interval_from_30s_to_24h(tmp_path):
    out = tmp_path / "sweep.json"
    ckpt_interval.main_ckpt_interval_bench(out=str(out), seeds=2)
    rows = json.loads(out.read_text())["rows"]
    assert [r["mtbf_s"] for r in rows][0] == 30 and rows[-1]["mtbf_s"] == 86400
    for r in rows:
        assert r["auto_goodput"] >= 0.99 * r["best_fixed_goodput"], r
    # the hindsight optimum moves with the failure rate, as Young/Daly says
    assert rows[0]["best_fixed_interval"] < rows[-1]["best_fixed_interval"] / 10


@pytest.mark.timeout(10)
def test_the_policy_counts_only_interruptions_that_lost_work(tmp_path):
    history = [{"t": 0.0, "event": "launch_started"}, {"t": 5.0, "event": "chaos_kill"}, {"t": 9.0, "event": "restart"},
               {"t": 20.0, "event": "preemption_notice"}, {"t": 20.5, "event": "emergency_checkpoint", "step": 7},
               {"t": 21.0, "event": "node_lost"}, {"t": 30.0, "event": "restart"},
               {"t": 40.0, "event": "worker_failed"}, {"t": 50.0, "event": "launch_started"}]
    assert lossy_interruptions(history) == 2  # the kill and the failed launch; the noticed one saved its work
    for e in history + [{"t": 60.0, "event": "checkpoint_saved", "step": 8, "stall_s": 2.0},
                        {"t": 61.0, "event": "checkpoint_saved", "step": 7, "stall_s": 99.0}]:
        append_jsonl(tmp_path / EVENTS_FILE, e)
    policy = IntervalPolicy(3600.0, 1.0, str(tmp_path), clock=lambda: 100.0)
    assert policy.interruptions == 2 and policy.stall_s == 2.0, "the emergency save's stall is not the interval's"
    assert policy.decide() is None, "no step timed yet"
    policy.observe_step(0.5)
    assert policy.mtbf_s() == pytest.approx((3600 + 100) / 3)
    steps = policy.decide()
    assert steps == interval_steps(0.5, 2.0, policy.mtbf_s())
    assert policy.decide(current=int(steps * 1.05)) == int(steps * 1.05), "within 10%: kept"
    assert policy.decide(current=steps * 2) == steps


@pytest.mark.timeout(60)
def test_a_session_with_auto_saves_where_its_interval_events_say(tmp_path, outside_torchrun):
    # A history of many failures (one every 3.6 s for an hour) makes the interval short enough to see in 80 steps.
    append_jsonl(tmp_path / EVENTS_FILE, {"t": time.time() - 3600, "event": "launch_started"})
    for i in range(1000):
        append_jsonl(tmp_path / EVENTS_FILE, {"t": time.time() - 3600 + i, "event": "chaos_kill"})
        append_jsonl(tmp_path / EVENTS_FILE, {"t": time.time() - 3600 + i, "event": "restart"})
    solo = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, restart_count=0)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with elastic.Session(None, solo, str(tmp_path), max_steps=80, every_n_steps="auto", log_every=10) as session:
        session.register(model=model)
        for _ in session.steps():
            time.sleep(0.005)
            session.step_done(loss=model(torch.ones(1, 4)).sum())
    events = read_jsonl(tmp_path / EVENTS_FILE)
    intervals = [e for e in events if e["event"] == "checkpoint_interval"]
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    assert intervals and intervals[0]["step"] == 5 and intervals[0]["previous"] is None
    assert intervals[0]["interruptions"] == 1000 and intervals[0]["mtbf_s"] < 10
    assert saved[0] == 5, "a new run's first save measures the stall"
    for before, after in zip(saved, saved[1:-1]):  # each periodic save falls where the latest decision said
        in_force = [e["every_n_steps"] for e in intervals if e["step"] < after][-1]
        assert after - before == in_force, (saved, intervals)
    assert saved[-1] == 80 and len(saved) >= 3


@pytest.fixture(scope="module")
def auto_preempted_run(tmp_path_factory) -> Path:
    """A short real run of `orch bench goodput`'s job (2 simulated nodes) with every_n_steps=auto, node 1
    preempted once training is under way."""
    def preempt(run_dir: Path) -> None:
        assert run_orch("chaos", "preempt", str(run_dir), "--node", "1", timeout=60).returncode == 0

    return preempt_midrun(tmp_path_factory.mktemp("auto"), [*JOB, "trainer.max_steps=300",
                                                            "checkpoint.every_n_steps=auto"], preempt, min_step=100)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_in_a_real_run_logs_its_interval_and_the_advisor_reads_it(auto_preempted_run):
    events = read_jsonl(auto_preempted_run / EVENTS_FILE)
    assert any(e["event"] == "emergency_checkpoint" for e in events)
    intervals = [e for e in events if e["event"] == "checkpoint_interval"]
    assert intervals and all(e["every_n_steps"] >= 1 and e["stall_s"] > 0 and e["step_s"] > 0 for e in intervals)
    advice = run_orch("advise", "checkpoint", str(auto_preempted_run), "--mtbf-h", "4", "--days", "5", "--seeds", "4")
    assert advice.returncode == 0, advice.stderr
    assert "Young/Daly interval:" in advice.stdout and "current" in advice.stdout and "/h" in advice.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calibrated_simulation_predicts_the_real_runs_goodput_within_ten_percent(auto_preempted_run, tmp_path):
    out = tmp_path / "predicted.json"
    done = run_orch("simulate", "--calibrate", str(auto_preempted_run), f"--out={out}")
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    measured = json.loads((auto_preempted_run / "summary.json").read_text())["goodput"]["goodput"]
    assert data["calibration"]["measured_goodput"] == pytest.approx(measured)
    assert data["interruptions"] == 1 and abs(data["goodput"] - measured) <= 0.1 * measured, (data["goodput"], measured)
