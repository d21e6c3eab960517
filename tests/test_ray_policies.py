"""The controller without Ray: its policies, and its state machine driven through a scripted NodePool.

The Ray-backed pool is exercised end to end in test_ray_launch.py; here every transition is forced, fast.
"""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator.config.compose import compose_config
from orchestrator.config.schema import FailureConfig
from orchestrator.controller import controller as controller_module
from orchestrator.controller.api import AgentExit, AgentStarted, ClusterNode
from orchestrator.controller.controller import Controller
from orchestrator.controller.failure_policy import (FAIL, FAILED, FINISHED, LOST, PREEMPTED, RESTART, STOPPED,
                                                    classify, decide)
from orchestrator.controller.scaling_policy import ScalingPolicy
from orchestrator.plan.plan import build_plan
from orchestrator.report.runlog import EventLog
from orchestrator.report.summary import recoveries

pytestmark = pytest.mark.timeout(60)


# -- failure policy ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exit, stopping, noticed, kind", [
    (AgentExit(0, exit_code=0), False, False, FINISHED),
    (AgentExit(0, exit_code=0), True, False, FINISHED),
    (AgentExit(0, exit_code=1), True, False, STOPPED),
    (AgentExit(0, exit_code=1), False, True, PREEMPTED),
    (AgentExit(0, actor_died=True, detail="node died"), False, False, LOST),
    (AgentExit(0, actor_died=True, detail="node died"), False, True, LOST),
    (AgentExit(0, exit_code=-9), False, False, LOST),
    (AgentExit(0, exit_code=1, death_signal="Signals.SIGTERM"), False, False, LOST),
    (AgentExit(0, exit_code=1), False, False, FAILED),
])
def test_classify_tells_loss_from_failure(exit, stopping, noticed, kind):
    assert classify(exit, stopping, noticed).kind == kind


def test_losses_never_spend_the_failure_budget():
    cfg = FailureConfig(max_failures=1, max_preemptions=-1)
    lost = classify(AgentExit(1, exit_code=-9), False, False)
    assert all(decide(lost, cfg, failures=0, preemptions=n).action == "continue" for n in range(1, 50))
    failed = classify(AgentExit(1, exit_code=1), False, False)
    assert decide(failed, cfg, failures=1, preemptions=40).action == RESTART
    last = decide(failed, cfg, failures=2, preemptions=0)
    assert last.action == FAIL and "failure.max_failures=1" in last.reason


def test_max_preemptions_bounds_losses():
    lost = classify(AgentExit(1, actor_died=True), False, False)
    cfg = FailureConfig(max_preemptions=2)
    assert decide(lost, cfg, 0, 2).action == "continue"
    assert decide(lost, cfg, 0, 3).action == FAIL and "failure.max_preemptions=2" in decide(lost, cfg, 0, 3).reason


# -- scaling policy ---------------------------------------------------------------------------------------------

def nodes(*slots: int) -> list[ClusterNode]:
    return [ClusterNode(f"n{i}", f"10.0.0.{i}", s) for i, s in enumerate(slots)]


def test_scaling_spreads_before_packing_up_to_max():
    policy = ScalingPolicy(min_nodes=1, max_nodes=3, wait_for_nodes_s=60)
    assert sorted(policy.decide(nodes(2, 2, 2), Counter(), True, 0).start_on) == ["n0", "n1", "n2"]
    assert sorted(policy.decide(nodes(3, 1), Counter(), True, 0).start_on) == ["n0", "n0", "n1"]
    assert policy.decide(nodes(1, 1, 1), Counter({"n0": 1, "n1": 1, "n2": 1}), True, 0).start_on == ()


def test_scaling_holds_growth_but_not_recovery_to_min():
    policy = ScalingPolicy(min_nodes=2, max_nodes=3, wait_for_nodes_s=60)
    assert policy.decide(nodes(1, 1, 1), Counter({"n0": 1, "n1": 1}), False, 0).start_on == ()
    assert policy.decide(nodes(1, 1, 1), Counter({"n0": 1}), False, 5).start_on != ()


def test_below_min_for_longer_than_wait_for_nodes_fails_saying_so():
    policy = ScalingPolicy(min_nodes=3, max_nodes=3, wait_for_nodes_s=10)
    assert policy.decide(nodes(1, 1), Counter(), True, 5).fail_reason is None
    reason = policy.decide(nodes(1, 1), Counter({"n0": 1, "n1": 1}), True, 11).fail_reason
    assert "only 2 of MIN=3 nodes" in reason and "failure.wait_for_nodes_s=10" in reason


# -- summary: recoveries ----------------------------------------------------------------------------------------

def test_recoveries_pair_each_loss_with_the_next_completed_step():
    events = [{"t": 1.0, "event": "first_step", "step": 1}, {"t": 10.0, "event": "chaos_kill", "node": 1},
              {"t": 10.1, "event": "node_lost", "node": 1}, {"t": 16.5, "event": "first_step", "step": 21, "world_size": 1},
              {"t": 30.0, "event": "node_lost", "node": 2}, {"t": 33.0, "event": "recovered", "step_t": 33.0}]
    found = recoveries(events)
    assert [r["mttr_s"] for r in found] == [6.5, 3.0]
    assert found[0]["cause"] == "chaos_kill" and found[0]["world_size"] == 1


# -- the state machine, through a scripted pool -----------------------------------------------------------------

class ScriptedPool:
    """A NodePool whose agents start at once and end when the test says so."""

    def __init__(self, node_slots: list[ClusterNode]):
        self.node_slots, self.started, self.stopped, self.pending = node_slots, [], [], []

    def nodes(self):
        return self.node_slots

    def start(self, spec, node_id):
        self.started.append(spec)
        self.pending.append(AgentStarted(spec.node, node_id, "10.0.0.9", 1000 + len(self.started)))

    def poll(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def stop(self, node, grace_s, agent_only=False):
        self.stopped.append(node)
        self.pending.append(AgentExit(node, exit_code=-15))

    def close(self):
        pass


@pytest.fixture
def make_controller(tmp_path, monkeypatch):
    monkeypatch.setattr(controller_module, "SCALE_INTERVAL_S", 0.0)

    def make(overrides: list[str], node_slots: list[ClusterNode]) -> tuple[Controller, ScriptedPool, EventLog]:
        cfg = compose_config("cpu_elastic", [*overrides, f"run.dir={tmp_path}"])
        plan = build_plan(cfg, str(tmp_path), "run-1", store_port=29400)
        events = EventLog(tmp_path)
        events.emit("launch_started", launcher="ray")
        pool = ScriptedPool(node_slots)
        return Controller(cfg, plan, pool, events), pool, events

    return make


def steps(c: Controller, n: int = 3) -> list[str]:
    return [c._step()[1].name for _ in range(n)]


def test_loss_then_recovery_then_growth(make_controller):
    c, pool, events = make_controller(["cluster.nnodes=1:2"], nodes(1, 1))
    assert steps(c, 2) == ["scheduling", "running"] and len(pool.started) == 2
    pool.pending.append(AgentExit(1, exit_code=-9))
    assert steps(c, 2) == ["recovering", "recovering"]
    assert len(pool.started) == 2, "no growth before the survivors have recovered"
    events.emit("first_step", step=21, world_size=1, restart_count=1)
    assert steps(c, 2) == ["running", "running"]
    assert len(pool.started) == 3 and pool.started[-1].node == 1, "node 1's slot is filled again"
    recovered = [e for e in events.read() if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["mttr_s"] >= 0
    events.emit("training_finished", steps_completed=60)
    pool.pending += [AgentExit(0, exit_code=0), AgentExit(1, exit_code=0)]
    assert c._step()[1].name == "finished" and c.state.status == "succeeded"


def test_user_failure_restarts_every_node_with_a_fresh_rendezvous_then_fails(make_controller):
    c, pool, events = make_controller(["cluster.nnodes=2", "failure.max_failures=1"], nodes(1, 1))
    steps(c, 2)
    first_ids = {a for s in pool.started for a in s.argv if a.startswith("--rdzv-id=")}
    pool.pending.append(AgentExit(1, exit_code=1))
    assert steps(c, 4) == ["stopping", "scheduling", "scheduling", "running"]
    assert pool.stopped == [0]
    new_ids = {a for s in pool.started[2:] for a in s.argv if a.startswith("--rdzv-id=")}
    assert new_ids == {"--rdzv-id=run-1-1"} and first_ids == {"--rdzv-id=run-1"}
    pool.pending.append(AgentExit(0, exit_code=1))
    assert steps(c, 2) == ["stopping", "failed"]
    assert "failure.max_failures=1" in c.state.reason
    kinds = Counter(e["event"] for e in events.read())
    assert kinds["node_failed"] == 2 and kinds["restart"] == 1 and kinds["node_stopped"] == 2


def test_too_few_nodes_fails_after_wait_for_nodes(make_controller):
    c, pool, _ = make_controller(["cluster.nnodes=2", "failure.wait_for_nodes_s=0.2"], nodes(1))
    assert c._step()[1].name == "scheduling"
    import time

    time.sleep(0.3)
    assert steps(c, 2)[-1] == "failed"
    assert "only 1 of MIN=2 nodes" in c.state.reason
