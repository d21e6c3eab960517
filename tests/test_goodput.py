"""Goodput: every second of a run with a node kill and a preemption notice lands in a named category.

Synthetic event streams (no processes) pin the arithmetic; one slow end-to-end run checks that a real launch
with a real kill and a real notice leaves ``other_s`` a small remainder.
"""

from __future__ import annotations

import pytest

from orchestrator.report.goodput import compute_goodput
from orchproc import read_jsonl, run_orch, start_orch, stop_tree, summary, wait_for

STEP_S = 0.1
STALL_S = 0.01


class Stream:
    """Builds events.jsonl and metrics.jsonl records of a run, in time order as a run writes them."""

    def __init__(self):
        self.events: list[dict] = []
        self.metrics: list[dict] = []

    def event(self, t: float, name: str, **fields) -> None:
        self.events.append({"t": t, "event": name, **fields})

    def startup(self, restart_count: int, worker_started: bool = True, restored: tuple[int, float] | None = None,
                **milestones: float) -> None:
        """One attempt's start-up: rendezvous_complete at process_group_t, then worker_started at ready_t."""
        self.event(milestones["process_group_t"], "rendezvous_complete", world_size=2, restart_count=restart_count)
        if restored:
            step, restore_s = restored
            self.event(milestones["restore_t"], "checkpoint_loaded", step=step, restore_s=restore_s)
        if worker_started:
            self.event(milestones["ready_t"], "worker_started", world_size=2, restart_count=restart_count,
                       **{k: v for k, v in milestones.items() if v is not None})

    def train(self, t: float, first: int, last: int, restart_count: int, every: int = 5) -> float:
        """Steps ``first..last`` from ``t``, STEP_S each, logged every step; a periodic save after every
        ``every``-th step stalls the loop STALL_S (inside the next step's window). Returns the end time."""
        self.event(t + STEP_S, "first_step", step=first, restart_count=restart_count)
        for step in range(first, last + 1):
            t += STEP_S
            self.metrics.append({"t": t, "step": step, "step_time_s": STEP_S, "loss": 1.0, "world_size": 2,
                                 "samples_per_s": 1.0, "restart_count": restart_count})
            if step % every == 0:
                self.event(t + 0.05, "checkpoint_saved", step=step, stall_s=STALL_S, write_s=0.03)
        return t


def kill_and_notice_run(worker_started: bool = True) -> tuple[Stream, dict[str, float]]:
    """Launch; 30 steps; node 1 killed during step 31 (resume from step 25: 5 steps lost); 30 more steps; a
    notice at step 55 (emergency save, node 0 leaves, a standby replaces it); steps 56-80; shutdown.
    Returns the stream and the badput each category must get (by the milestones below)."""
    s = Stream()
    s.event(0.0, "launch_started", preset="cpu_elastic")
    s.event(0.01, "node_started", node=0, pid=100)
    s.event(0.02, "node_started", node=1, pid=101)
    # Attempt 0: agents up at 0.5, workers spawned at 4.0 (rendezvous round), imports, process group, model.
    s.startup(0, worker_started, agent_start_t=0.5, process_start_t=4.0, entry_t=4.3, imports_t=6.5, config_t=6.6,
              process_group_t=7.0, model_t=8.0, restore_t=8.05, ready_t=8.2)
    end0 = s.train(8.2, 1, 30, 0)  # 11.2
    s.event(11.25, "chaos_kill", node=1, signal="SIGKILL")
    s.event(11.3, "worker_failed", rank=0, node=0, error="RuntimeError: peer closed")
    s.event(11.35, "node_lost", node=1, reason="agent killed by SIGKILL")
    # Attempt 1: the survivor's agent is old (0.5); it re-rendezvoused and spawned workers at 14.0.
    s.startup(1, worker_started, restored=(25, 0.3), agent_start_t=0.5, process_start_t=14.0, entry_t=14.2,
              imports_t=16.0, config_t=16.1, process_group_t=16.6, model_t=17.5, restore_t=17.8, ready_t=17.9)
    s.event(16.61, "restart", restart_count=1)
    end1 = s.train(17.9, 26, 55, 1)  # 20.9
    s.event(end1, "preemption_notice", node=0, source="chaos", step=55)
    s.event(end1 + 0.4, "emergency_checkpoint", step=55, save_s=0.3)  # agreement 0.1 s, then the save
    s.event(end1 + 0.6, "node_standby_started", node=0, pid=200)
    s.event(end1 + 2.0, "node_preempted", node=0, exit_code=0)
    s.event(end1 + 2.0, "node_started", node=0, pid=200, replacement=True, standby=True)
    # Attempt 2: the standby's agent started at end1 + 0.6, its workers at end1 + 5.
    s.startup(0, worker_started, restored=(55, 0.2), agent_start_t=end1 + 0.6, process_start_t=end1 + 5.0,
              entry_t=end1 + 5.2, imports_t=end1 + 7.0, config_t=end1 + 7.1, process_group_t=end1 + 7.5,
              model_t=end1 + 8.5, restore_t=end1 + 8.7, ready_t=end1 + 8.8)
    end2 = s.train(end1 + 8.8, 56, 80, 0)
    s.event(end2 + 0.5, "training_finished", steps_completed=80)
    s.event(end2 + 2.0, "run_finished", status="succeeded")
    stalls = 16 * STALL_S  # saves after steps 5..75 (step 80's is after the last step: shutdown)
    expected = {
        "launch_s": 0.5,
        "waiting_for_nodes_s": 0.6 - 0.4,  # the emergency save ended at end1 + 0.4
        "rendezvous_s": (4.0 - 0.5) + (7.0 - 6.6) + (14.0 - 11.25) + (16.6 - 16.1) + (5.0 - 0.6) + (7.5 - 7.1),
        "worker_start_s": (6.6 - 4.0) + (8.0 - 7.0) + (8.2 - 8.05) + (16.1 - 14.0) + (17.5 - 16.6) + (17.9 - 17.8)
        + (7.1 - 5.0) + (8.5 - 7.5) + (8.8 - 8.7),
        "restore_s": 0.05 + 0.3 + 0.2,
        "checkpoint_stall_s": stalls + 0.3,
        # steps 26-30 and step 31 in flight, less two saves: after step 25 (in step 26's window), after step 30
        "lost_s": 5 * STEP_S + (11.25 - end0) - 2 * STALL_S,
        "shutdown_s": 2.0 - STALL_S,  # the save after the last step blocks there
        "other_s": 0.1,  # the preemption agreement before the emergency save
    }
    return s, expected


@pytest.mark.timeout(10)
def test_kill_and_notice_every_second_is_named():
    s, expected = kill_and_notice_run()
    g = compute_goodput(s.events, s.metrics)
    assert g["badput"] == pytest.approx(expected, abs=1e-3)
    assert g["productive_s"] == pytest.approx(80 * STEP_S - 13 * STALL_S, abs=1e-6)  # saves inside kept windows
    assert g["lost_steps"] == 5
    assert g["productive_s"] + sum(g["badput"].values()) == pytest.approx(g["wall_s"], abs=1e-3)
    assert g["badput"]["other_s"] < 0.1 * g["wall_s"]
    assert [a["cause"] for a in g["attempts"]] == ["launch", "failure", "preemption"]
    assert [a["step"] for a in g["attempts"]] == [1, 26, 56]
    for a in g["attempts"]:  # each gap is explained by its own split
        parts = sum(v for k, v in a.items() if k.endswith("_s") and k not in ("gap_s", "at_s"))
        assert a["gap_s"] - parts == pytest.approx(0.1 if a["cause"] == "preemption" else 0.0, abs=1e-3)


@pytest.mark.timeout(10)
def test_without_worker_started_the_launcher_and_rank0_events_stand_in():
    """A user entrypoint or an older run dir: worker imports count as rendezvous; still nothing is 'other'."""
    s, _ = kill_and_notice_run(worker_started=False)
    g = compute_goodput(s.events, s.metrics)
    b = g["badput"]
    assert g["productive_s"] + sum(b.values()) == pytest.approx(g["wall_s"], abs=1e-3)
    assert b["other_s"] == pytest.approx(0.1, abs=1e-3)
    assert b["launch_s"] == pytest.approx(0.02)  # the last node_started
    assert b["waiting_for_nodes_s"] == pytest.approx(0.2)  # the standby's node_standby_started, not node_started
    assert b["restore_s"] == pytest.approx(0.5)  # from checkpoint_loaded's restore_s (attempt 0 restored nothing)
    # rendezvous_complete = process-group init: everything between the node and it counts as rendezvous
    assert b["rendezvous_s"] == pytest.approx((7.0 - 0.02) + (16.6 - 11.25) + (7.5 - 0.6), abs=1e-3)


@pytest.mark.timeout(10)
def test_periodic_save_stalls_are_not_also_productive():
    s = Stream()
    s.event(0.0, "launch_started")
    s.startup(0, agent_start_t=0.1, process_start_t=1.0, process_group_t=2.0, model_t=2.5, restore_t=2.5, ready_t=3.0)
    end = s.train(3.0, 1, 20, 0)
    s.event(end + 1.0, "run_finished", status="succeeded")
    g = compute_goodput(s.events, s.metrics)
    assert g["badput"]["checkpoint_stall_s"] == pytest.approx(4 * STALL_S)  # steps 5, 10, 15, 20 (the last: shutdown)
    assert g["productive_s"] == pytest.approx(20 * STEP_S - 3 * STALL_S)
    assert g["badput"]["shutdown_s"] == pytest.approx(1.0 - STALL_S)
    assert g["productive_s"] + sum(g["badput"].values()) == pytest.approx(g["wall_s"], abs=1e-6)
    assert g["badput"]["other_s"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.timeout(10)
def test_an_emergency_save_keeps_steps_logged_after_it_as_productive():
    """log_every 10, notice at step 14: steps 11-14 have no metrics line, but the emergency checkpoint keeps them."""
    s = Stream()
    s.event(0.0, "launch_started")
    s.startup(0, agent_start_t=0.0, process_start_t=1.0, process_group_t=2.0, ready_t=3.0)
    s.event(3.1, "first_step", step=1)
    s.metrics.append({"t": 4.0, "step": 10, "step_time_s": STEP_S})
    s.event(4.0 + 4 * STEP_S + 0.3, "emergency_checkpoint", step=14, save_s=0.3)
    restart = 4.0 + 4 * STEP_S + 0.3
    s.startup(1, process_start_t=restart + 1.0, process_group_t=restart + 2.0, ready_t=restart + 3.0)
    s.event(restart + 3.1, "first_step", step=15)
    s.metrics.append({"t": restart + 3.0 + 6 * STEP_S, "step": 20, "step_time_s": STEP_S})
    s.event(restart + 3.0 + 6 * STEP_S + 1.0, "run_finished", status="succeeded")
    g = compute_goodput(s.events, s.metrics)
    assert g["productive_s"] == pytest.approx(20 * STEP_S)
    assert g["lost_steps"] == 0 and g["badput"]["lost_s"] == 0.0
    assert g["badput"]["checkpoint_stall_s"] == pytest.approx(0.3)
    assert g["badput"]["other_s"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.timeout(10)
def test_a_node_lost_after_training_finished_is_shutdown_not_lost_work():
    s = Stream()
    s.event(0.0, "launch_started")
    s.startup(0, agent_start_t=0.0, process_start_t=1.0, process_group_t=2.0, ready_t=3.0)
    end = s.train(3.0, 1, 4, 0)
    s.event(end + 0.5, "training_finished", steps_completed=4)
    s.event(end + 1.0, "node_lost", node=1, reason="agent killed by SIGKILL")
    s.event(end + 2.0, "run_finished", status="succeeded")
    g = compute_goodput(s.events, s.metrics)
    assert g["badput"]["lost_s"] == 0.0 and g["badput"]["shutdown_s"] == pytest.approx(2.0)


@pytest.mark.timeout(10)
def test_a_plain_script_that_reports_no_steps_counts_its_run_time():
    """A plain torchrun script is seen from outside: its round's start to its first node's exit 0 is its training
    (goodput was 0.0%, every second shutdown)."""
    s = Stream()
    s.event(0.0, "launch_started", command_t=-1.0)
    s.event(0.5, "node_started", node=0)
    s.event(2.0, "rendezvous_complete", world_size=2, restart_count=0)
    s.event(12.0, "node_finished", node=0, exit_code=0)
    s.event(12.2, "node_finished", node=1, exit_code=0)
    s.event(13.0, "run_finished", status="succeeded")
    g = compute_goodput(s.events, s.metrics)
    assert g["productive_s"] == pytest.approx(10.0) and g["wall_s"] == pytest.approx(14.0)
    assert g["goodput"] == pytest.approx(10 / 14) and g["badput"]["shutdown_s"] == pytest.approx(1.0)
    assert g["badput"]["launch_s"] == pytest.approx(1.5), "from the command's start to its agent's start"
    bare = [e for e in s.events if e["event"] != "rendezvous_complete"]  # torchrun's own rounds: none recorded
    assert compute_goodput(bare, [])["productive_s"] == pytest.approx(11.5), "from its agent's start"


@pytest.mark.timeout(10)
def test_no_goodput_without_a_finished_run():
    s, _ = kill_and_notice_run()
    assert compute_goodput(s.events[:-1], s.metrics) is None


# -- end to end ----------------------------------------------------------------------------------------------

E2E = ["conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2", "trainer.max_steps=150", "trainer.log_every=1",
       "checkpoint.every_n_steps=5"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_real_kill_and_notice_leave_other_under_ten_percent(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "orch.log"
    proc = start_orch("launch", *E2E, f"run.dir={run_dir}", log=log)
    try:
        def events(name):
            return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]

        def at_step(step):
            def check():
                assert proc.poll() is None, log.read_text()[-3000:]
                return any(m["step"] >= step for m in read_jsonl(run_dir / "metrics.jsonl"))
            return check

        wait_for(at_step(15), 180, "step 15")
        killed = run_orch("chaos", "kill-node", str(run_dir), "--node", "1", timeout=60)
        assert killed.returncode == 0, killed.stderr
        wait_for(lambda: len(events("first_step")) >= 2, 180, "the first step after the kill")
        wait_for(at_step(max(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")) + 10), 120, "10 more steps")
        preempted = run_orch("chaos", "preempt", str(run_dir), "--node", "0", "--grace", "60", timeout=120)
        assert preempted.returncode == 0, preempted.stderr
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    s = summary(run_dir)
    g = s["goodput"]
    assert s["status"] == "succeeded" and s["steps_completed"] == 150
    assert [a["cause"] for a in g["attempts"]][:1] == ["launch"] and {"failure", "preemption"} <= {
        a["cause"] for a in g["attempts"]}, g["attempts"]
    assert len(events("worker_started")) == len(g["attempts"]), "one worker_started per attempt"
    assert g["productive_s"] + sum(g["badput"].values()) == pytest.approx(g["wall_s"], abs=0.05)
    assert g["badput"]["other_s"] < 0.1 * g["wall_s"], g
    assert g["badput"]["worker_start_s"] > 0 and g["badput"]["rendezvous_s"] > 0, g
