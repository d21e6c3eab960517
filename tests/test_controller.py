"""The one controller, without processes: its policies, and its state machine driven through a scripted
NodePool and a manual clock. Every launcher (local, Ray, test clusters) runs this controller; the real pools
are exercised end to end in test_launch_local.py, test_ray_launch.py and test_testcluster_launch.py.
"""

from __future__ import annotations

import json

import signal
from collections import Counter

import pytest

from orchestrator.config.compose import compose_config
from orchestrator.config.schema import FailureConfig
from orchestrator.controller import controller as controller_module
from orchestrator.controller.agents import AgentMaker
from orchestrator.controller.api import AgentExit, AgentStarted, ClusterNode, ExitKind, ManualClock, RunHooks, RunStatus
from orchestrator.controller.controller import Controller
from orchestrator.controller.exit_barrier import EXIT_BARRIER_GRACE_S, EXIT_TIMEOUT_S
from orchestrator.controller.failure_policy import (FailureAction, classify, decide, failure_signature,
                                                    same_failure)
from orchestrator.controller.scaling_policy import ScalingPolicy
from orchestrator.controller.standby_policy import standbys_to_boot
from orchestrator.controller.worker_view import Notice
from orchestrator.ft.driver import driver_mode
from orchestrator.plan.plan import build_plan
from orchestrator.report.summary import recoveries
from orchestrator.rundir import EventLog

pytestmark = pytest.mark.timeout(60)


# -- failure policy ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exit, stopping, noticed, kind", [
    (AgentExit(0, 0, exit_code=0), False, False, ExitKind.FINISHED),
    (AgentExit(0, 0, exit_code=0), True, False, ExitKind.FINISHED),
    (AgentExit(0, 0, exit_code=0), False, True, ExitKind.PREEMPTED),  # torchrun's SIGTERM path may exit 0
    (AgentExit(0, 0, exit_code=1), True, False, ExitKind.STOPPED),
    (AgentExit(0, 0, exit_code=1), False, True, ExitKind.PREEMPTED),
    (AgentExit(0, 0, actor_died=True, detail="node died"), False, False, ExitKind.LOST),
    (AgentExit(0, 0, actor_died=True, detail="node died"), False, True, ExitKind.LOST),
    (AgentExit(0, 0, exit_code=-9), False, False, ExitKind.LOST),
    (AgentExit(0, 0, exit_code=1, death_signal="Signals.SIGTERM"), False, False, ExitKind.LOST),
    (AgentExit(0, 0, exit_code=1), False, False, ExitKind.FAILED),
])
def test_classify_tells_loss_from_failure(exit, stopping, noticed, kind):
    assert classify(exit, stopping, noticed).kind == kind


def test_a_notice_after_training_finished_does_not_make_a_clean_exit_a_preemption():
    assert classify(AgentExit(0, 0, exit_code=0), False, True, training_finished=True).kind == ExitKind.FINISHED


def test_an_exit_the_surroundings_explain_is_a_loss():
    verdict = classify(AgentExit(0, 2, exit_code=1), False, False, explained="cut off by a network partition")
    assert verdict.kind == ExitKind.LOST and "partition" in verdict.reason


def test_losses_never_spend_the_failure_budget():
    cfg = FailureConfig(max_failures=1, max_preemptions=-1)
    lost = classify(AgentExit(1, 1, exit_code=-9), False, False)
    assert all(decide(lost, cfg, failures=0, preemptions=n).action == FailureAction.CONTINUE for n in range(1, 50))
    failed = classify(AgentExit(1, 1, exit_code=1), False, False)
    assert decide(failed, cfg, failures=1, preemptions=40).action == FailureAction.RESTART
    last = decide(failed, cfg, failures=2, preemptions=0)
    assert last.action == FailureAction.FAIL and "failure.max_failures=1" in last.reason


def test_max_preemptions_bounds_losses():
    lost = classify(AgentExit(1, 1, actor_died=True), False, False)
    cfg = FailureConfig(max_preemptions=2)
    assert decide(lost, cfg, 0, 2).action == FailureAction.CONTINUE
    assert decide(lost, cfg, 0, 3).action == FailureAction.FAIL
    assert "failure.max_preemptions=2" in decide(lost, cfg, 0, 3).reason


def test_failure_signature_from_worker_events_or_the_node_log(tmp_path):
    events = [{"t": 2.0, "rank": 1, "error": "ValueError: bad row 17"}, {"t": 1.0, "rank": 0, "error": "KeyError: 'x'"}]
    assert failure_signature(events, tmp_path / "none.log", 0) == "rank 0: KeyError: 'x'"
    log = tmp_path / "node0.log"
    log.write_text("old run\n[node0-local0]:ValueError: stale\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("[node0-local0]:Traceback (most recent call last):\n[node0-local0]:  File \"x.py\", line 3\n"
                "[node0-local0]:RuntimeError: deliberate at step 5 (pid 41234)\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert failure_signature([], log, offset) == "RuntimeError: deliberate at step 5 (pid 41234)"
    assert failure_signature([], log, log.stat().st_size) is None
    assert same_failure("RuntimeError: deliberate at step 5 (pid 41234)", "RuntimeError: deliberate at step 5 (pid 50321)")
    assert not same_failure("RuntimeError: at step 5", "RuntimeError: at step 6")
    assert not same_failure(None, None)


# -- scaling and standby policies -------------------------------------------------------------------------------

def machines(*slots: int) -> list[ClusterNode]:
    return [ClusterNode(f"n{i}", f"10.0.0.{i}", s) for i, s in enumerate(slots)]


def test_scaling_spreads_before_packing_up_to_max():
    policy = ScalingPolicy(min_nodes=1, max_nodes=3, wait_for_nodes_s=60)
    assert sorted(policy.decide(machines(2, 2, 2), Counter(), True, 0).start_on) == ["n0", "n1", "n2"]
    assert sorted(policy.decide(machines(3, 1), Counter(), True, 0).start_on) == ["n0", "n0", "n1"]
    assert policy.decide(machines(1, 1, 1), Counter({"n0": 1, "n1": 1, "n2": 1}), True, 0).start_on == ()


def test_scaling_holds_growth_but_not_recovery_to_min():
    policy = ScalingPolicy(min_nodes=2, max_nodes=3, wait_for_nodes_s=60)
    assert policy.decide(machines(1, 1, 1), Counter({"n0": 1, "n1": 1}), False, 0).start_on == ()
    assert policy.decide(machines(1, 1, 1), Counter({"n0": 1}), False, 5).start_on != ()


def test_standbys_take_slots_but_do_not_count_toward_the_size():
    policy = ScalingPolicy(min_nodes=1, max_nodes=2, wait_for_nodes_s=60)
    assert policy.decide(machines(1, 1), Counter({"n0": 1}), True, 0, Counter({"n1": 1})).start_on == ()
    assert policy.decide(machines(2, 1), Counter({"n0": 1}), True, 0, Counter({"n1": 1})).start_on == ("n0",)


def test_below_min_for_longer_than_wait_for_nodes_fails_saying_so():
    policy = ScalingPolicy(min_nodes=3, max_nodes=3, wait_for_nodes_s=10)
    assert policy.decide(machines(1, 1), Counter(), True, 5).fail_reason is None
    reason = policy.decide(machines(1, 1), Counter({"n0": 1, "n1": 1}), True, 11).fail_reason
    assert "only 2 of MIN=3 nodes" in reason and "failure.wait_for_nodes_s=10" in reason


def test_standby_policy_boots_once_per_notice_never_for_sigterm():
    notices = [Notice(1, 5.0, "chaos"), Notice(1, 6.0, "chaos"), Notice(0, 5.0, "sigterm"), Notice(2, 1.0, "aws")]
    assert standbys_to_boot(notices, {0: 0.0, 1: 0.0, 2: 2.0}, set()) == [1], "node 2's notice predates its agent"
    assert standbys_to_boot(notices, {0: 0.0, 1: 0.0}, {1}) == []


# -- summary: recoveries ----------------------------------------------------------------------------------------

def test_recoveries_pair_each_loss_with_the_next_completed_step():
    events = [{"t": 1.0, "event": "first_step", "step": 1}, {"t": 10.0, "event": "chaos_kill", "node": 1},
              {"t": 10.1, "event": "node_lost", "node": 1}, {"t": 16.5, "event": "first_step", "step": 21, "world_size": 1},
              {"t": 30.0, "event": "node_lost", "node": 2}, {"t": 33.0, "event": "recovered", "step_t": 33.0}]
    found = recoveries(events)
    assert [r["mttr_s"] for r in found] == [6.5, 3.0]
    assert found[0]["cause"] == "chaos_kill" and found[0]["world_size"] == 1
    # A preempted node is a loss too, whatever the script style (the controller records it from the exit 75)
    preempted = recoveries([{"t": 1.0, "event": "first_step", "step": 1}, {"t": 5.0, "event": "node_preempted", "node": 1},
                            {"t": 5.2, "event": "node_preempted", "node": 0}, {"t": 9.0, "event": "first_step", "step": 16}])
    assert [(r["cause"], r["mttr_s"], r["step"]) for r in preempted] == [("node_preempted", 4.0, 16)]


def test_the_printed_summary_names_preemptions_and_recoveries():
    from orchestrator.report.summary import summary_details

    lines = summary_details({"preemptions": 1, "recoveries": [{"mttr_s": 4.0}]})
    assert lines == ["preemptions 1: node(s) left on a notice after an emergency checkpoint", "recoveries 1: MTTR 4.0 s"]


# -- the state machine, through a scripted pool and a manual clock ----------------------------------------------

class ScriptedPool:
    """A NodePool whose agents start at once and end when the test says so (``exit(node, code)``)."""

    def __init__(self, node_slots: list[ClusterNode]):
        self.node_slots, self.started, self.stopped, self.pending = node_slots, [], [], []
        self.live: dict[int, object] = {}  # agent id -> spec

    def nodes(self):
        return self.node_slots

    def start(self, spec, node_id):
        self.started.append(spec)
        self.live[spec.agent_id] = spec
        self.pending.append(AgentStarted(spec.agent_id, spec.node, node_id, "10.0.0.9", 1000 + spec.agent_id))

    def poll(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def stop(self, agent_id, grace_s, agent_only=False):
        self.stopped.append((self.live[agent_id].node, agent_only))
        self.exit_agent(agent_id, -15)

    def exit_agent(self, agent_id, code=None, **kw):
        spec = self.live.pop(agent_id)
        self.pending.append(AgentExit(agent_id, spec.node, exit_code=code, **kw))

    def exit(self, node, code=None, **kw):
        """End the agent now playing ``node`` (the newest one started for it)."""
        agent_id = max(a for a, s in self.live.items() if s.node == node)
        self.exit_agent(agent_id, code, **kw)

    def close(self):
        pass


@pytest.fixture
def make_controller(tmp_path, monkeypatch):
    monkeypatch.setattr(controller_module, "SCALE_INTERVAL_S", 0.0)

    def make(overrides: list[str], node_slots: list[ClusterNode], evict=None, pod=False, **kw):
        """``evict(rdzv_id, pid)``: the store's eviction (restart mode takes a departed agent out through it);
        ``pod``: the site's hooks of a Kubernetes pod (the run's records may land in another pod)."""
        cfg = compose_config("cpu_elastic", [*overrides, f"run.dir={tmp_path}"])
        plan = build_plan(cfg, str(tmp_path), "run-1", store_port=29400)
        clock = ManualClock()
        events = EventLog(tmp_path, clock=clock.time)
        events.emit("launch_started", launcher="test")
        pool = ScriptedPool(node_slots)
        mode = driver_mode(cfg)
        mode.host(type("Store", (), {"evict": staticmethod(evict)})() if evict else None, events)
        if pod:
            kw["hooks"] = type("PodHooks", (RunHooks,), {"records_training": False})()
        agents = AgentMaker(plan, mode, {}, gated=True)
        return Controller(cfg, plan, pool, events, agents, clock=clock, **kw), pool, events, clock

    return make


def steps(c: Controller, n: int = 3) -> list[str]:
    return [str(c._step()[1].name) for _ in range(n)]


def events_named(events: EventLog, name: str) -> list[dict]:
    return [e for e in events.read() if e["event"] == name]


def test_loss_then_recovery_then_growth(make_controller):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2"], machines(1, 1))
    assert steps(c, 2) == ["scheduling", "running"] and len(pool.started) == 2
    clock.advance(5)
    pool.exit(1, -9)
    assert steps(c, 2) == ["recovering", "recovering"]
    assert len(pool.started) == 2, "no growth before the survivors have recovered"
    clock.advance(6.5)
    events.emit("first_step", step=21, world_size=1, restart_count=1)
    assert steps(c, 2) == ["running", "running"]
    assert len(pool.started) == 3 and pool.started[-1].node == 1, "node 1's slot is filled again"
    recovered = events_named(events, "recovered")
    assert len(recovered) == 1 and recovered[0]["mttr_s"] == 6.5
    c._step()
    assert [e["replacement"] for e in events_named(events, "node_started")] == [False, False, True]
    events.emit("training_finished", steps_completed=60)
    pool.exit(0, 0)
    pool.exit(1, 0)
    assert c._step()[1].name == "finished" and c.state.status == RunStatus.SUCCEEDED


def test_survivors_that_committed_before_the_loss_was_seen_are_recovered_and_the_job_grows(make_controller, tmp_path):
    """per_step on a Ray cluster: the survivors' quorum drops the dead group (its heartbeats) and commits before
    the controller learns the agent is gone, so no first step or quorum change follows the loss it notes. The
    survivors' heartbeats show steps completed after it: recovered, and growth (node 1 again) goes ahead."""
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2", "fault_tolerance.mode=per_step"], machines(1, 1))
    assert steps(c, 2) == ["scheduling", "running"] and len(pool.started) == 2
    clock.advance(5)
    events.emit("quorum_changed", step=40, replicas=1, previous=2, world_size=1)  # before the exit is seen
    clock.advance(1.5)
    pool.exit(1, -9)
    assert steps(c, 2) == ["recovering", "recovering"] and len(pool.started) == 2
    beats = tmp_path / "heartbeats"
    beats.mkdir(exist_ok=True)
    clock.advance(0.4)
    (beats / "node0-rank0.json").write_text(json.dumps({"t": clock.time(), "pid": 1, "node": 0, "rank": 0,
                                                        "step": 44, "step_t": clock.time() - 0.1}))
    clock.advance(0.6)
    assert steps(c, 2) == ["running", "running"]
    recovered = events_named(events, "recovered")
    assert len(recovered) == 1 and recovered[0]["step"] == 44 and recovered[0]["mttr_s"] == pytest.approx(0.3)
    assert len(pool.started) == 3 and pool.started[-1].node == 1, "node 1's slot is filled again"


def test_a_group_that_finished_first_is_not_replaced(make_controller):
    """per_step's groups finish one by one: the first agent to exit 0 is the end of training, not a slot to
    fill again (a replacement started then only healed, found nothing to train and delayed the run's end)."""
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2", "fault_tolerance.mode=per_step"], machines(1, 1))
    steps(c, 2)
    clock.advance(5)
    pool.exit(1, 0)
    assert steps(c, 3) == ["running"] * 3 and len(pool.started) == 2
    events.emit("training_finished", steps_completed=60)
    pool.exit(0, 0)
    assert c._step()[1].name == "finished" and c.state.status == RunStatus.SUCCEEDED


def test_a_heartbeat_from_before_the_loss_is_no_recovery(make_controller, tmp_path):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2"], machines(1, 1))
    steps(c, 2)
    beats = tmp_path / "heartbeats"
    beats.mkdir(exist_ok=True)
    (beats / "node0-rank0.json").write_text(json.dumps({"t": clock.time(), "pid": 1, "node": 0, "rank": 0,
                                                        "step": 30, "step_t": clock.time()}))
    clock.advance(2)
    pool.exit(1, -9)
    clock.advance(5)
    assert steps(c, 3) == ["recovering"] * 3 and not events_named(events, "recovered")


def test_a_lost_agent_is_evicted_from_the_rendezvous_and_a_reopened_round_is_recorded(make_controller):
    evicted = []

    class Result:
        reopened, round = True, 3

        def __bool__(self):
            return True

    c, pool, events, _ = make_controller(["cluster.nnodes=1:2"], machines(1, 1),
                                         evict=lambda rdzv, pid: evicted.append((rdzv, pid)) or Result())
    steps(c, 2)
    pool.exit(1, -9)
    c._step()
    assert evicted == [("run-1", 1001)]
    assert events_named(events, "rendezvous_evicted")[0]["agent_pid"] == 1001
    assert events_named(events, "rendezvous_reopened")[0]["round"] == 3


def test_user_failure_restarts_every_node_with_a_fresh_rendezvous_then_exhausts_the_budget(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=2", "failure.max_failures=1"], machines(1, 1))
    steps(c, 2)
    first_ids = {a for s in pool.started for a in s.argv if a.startswith("--rdzv-id=")}
    events.emit("worker_failed", rank=1, node=1, error="ValueError: first")
    pool.exit(1, 1)
    assert steps(c, 4) == ["stopping", "scheduling", "scheduling", "running"]
    assert pool.stopped == [(0, False)]
    new_ids = {a for s in pool.started[2:] for a in s.argv if a.startswith("--rdzv-id=")}
    assert new_ids == {"--rdzv-id=run-1-1"} and first_ids == {"--rdzv-id=run-1"}
    events.emit("worker_failed", rank=0, node=0, error="KeyError: second")
    pool.exit(0, 1)
    assert steps(c, 2) == ["stopping", "failed"]
    assert "failure.max_failures=1" in c.state.reason
    kinds = Counter(e["event"] for e in events.read())
    assert kinds["node_failed"] == 2 and kinds["restart"] == 1 and kinds["node_stopped"] == 2
    assert kinds["deterministic_failure"] == 0, "two different errors are not one deterministic failure"


def test_the_same_failure_twice_ends_the_run_naming_it(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=2", "failure.max_failures=10"], machines(1, 1))
    steps(c, 2)
    events.emit("worker_failed", rank=1, node=1, error="ZeroDivisionError: division by zero")
    pool.exit(1, 1)
    assert steps(c, 4) == ["stopping", "scheduling", "scheduling", "running"]
    events.emit("worker_failed", rank=1, node=1, error="ZeroDivisionError: division by zero")
    pool.exit(1, 1)
    assert steps(c, 2) == ["stopping", "failed"] and c.attempt == 1
    assert "the same failure on two attempts in a row" in c.state.reason
    assert "rank 1: ZeroDivisionError: division by zero" in c.state.reason
    [det] = events_named(events, "deterministic_failure")
    assert det["failure"] == "rank 1: ZeroDivisionError: division by zero"


def test_a_noticed_node_is_preempted_even_on_exit_0_and_replaced_without_waiting(make_controller):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2", "preemption.replace_nodes=false"], machines(1, 1))
    steps(c, 2)
    clock.advance(1)
    events.emit("preemption_notice", node=1, source="chaos")
    c._step()
    pool.exit(1, 0)
    assert steps(c, 2) == ["recovering", "recovering"]
    assert events_named(events, "node_preempted") and not events_named(events, "node_finished")
    assert len(pool.started) == 2, "replace_nodes=false: the slot waits for recovery like any loss"


def test_a_notice_boots_a_standby_that_takes_over_when_the_node_leaves(make_controller):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2"], machines(2, 2))
    steps(c, 2)
    clock.advance(1)
    events.emit("preemption_notice", node=1, source="chaos")
    c._step()
    assert len(pool.started) == 3 and pool.started[-1].node == 1 and pool.started[-1].agent_id == 2
    c._step()
    [standby] = events_named(events, "node_standby_started")
    assert standby["node"] == 1 and standby["pid"] == 1002
    pool.exit_agent(1, 1)  # the noticed agent leaves after its emergency checkpoint
    steps(c, 2)
    assert events_named(events, "node_preempted")[0]["node"] == 1
    took_over = events_named(events, "node_started")[-1]
    assert took_over == {**took_over, "node": 1, "pid": 1002, "replacement": True, "standby": True}
    assert len(pool.started) == 3, "the standby plays node 1: nothing else is started"
    c._step()
    assert len(pool.started) == 3


def test_a_sigterm_notice_boots_no_standby(make_controller):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2"], machines(2, 2))
    steps(c, 2)
    events.emit("preemption_notice", node=1, source="sigterm")
    steps(c, 2)
    assert len(pool.started) == 2 and not events_named(events, "node_standby_started")


def test_sigterm_to_orch_notifies_every_node_then_ends_preempted(make_controller):
    notified = []
    c, pool, events, _ = make_controller(["cluster.nnodes=2"], machines(1, 1),
                                         notify=lambda node, pid, grace: notified.append((node, pid, grace)))
    steps(c, 2)
    c.request_stop(signal.SIGTERM)
    assert steps(c, 2) == ["stopping", "finished"]
    assert sorted(notified) == [(0, 1000, 30.0), (1, 1001, 30.0)]
    assert sorted(pool.stopped) == [(0, True), (1, True)], "torchrun alone is signalled: it forwards to its workers"
    assert c.state.status == RunStatus.PREEMPTED and events_named(events, "preemption_notice_forwarded")


def test_sigterm_after_the_last_step_is_a_success(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=2"], machines(1, 1))
    steps(c, 2)
    events.emit("training_finished", steps_completed=60)
    c.request_stop(signal.SIGTERM)
    steps(c, 2)
    assert c.state.status == RunStatus.SUCCEEDED


def test_sigint_interrupts(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=2"], machines(1, 1))
    steps(c, 2)
    c.request_stop(signal.SIGINT)
    assert steps(c, 2) == ["stopping", "finished"] and c.state.status == RunStatus.INTERRUPTED
    assert sorted(pool.stopped) == [(0, False), (1, False)]


def test_agents_waiting_in_the_exit_barrier_are_stopped_after_the_grace(make_controller):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2"], machines(1, 1))
    steps(c, 2)
    events.emit("training_finished", steps_completed=60)
    pool.exit(0, 0)
    steps(c, 2)
    assert pool.stopped == []
    clock.advance(EXIT_BARRIER_GRACE_S + 1)
    assert steps(c, 2) == ["running", "finished"]
    assert pool.stopped == [(1, False)] and events_named(events, "agents_stopped")
    assert c.state.status == RunStatus.SUCCEEDED


def test_slow_exits_after_the_last_step_get_longer_when_no_agent_has_left(make_controller):
    c, pool, events, clock = make_controller(["cluster.nnodes=1:2"], machines(1, 1))
    steps(c, 2)
    events.emit("training_finished", steps_completed=60)
    steps(c, 1)
    clock.advance(EXIT_BARRIER_GRACE_S + 1)
    steps(c, 2)
    assert pool.stopped == [], "workers may still be writing their last checkpoint"
    clock.advance(EXIT_TIMEOUT_S)
    steps(c, 2)
    assert sorted(pool.stopped) == [(0, False), (1, False)]


def test_a_pod_plays_its_own_node_and_succeeds_on_its_agents_clean_exit(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=2"], machines(4), nodes=[1], pod=True)
    assert steps(c, 2) == ["scheduling", "running"]
    assert [s.node for s in pool.started] == [1], "MIN is the pod's share of the job: one node"
    pool.exit(1, 0)  # rank 0 trained in another pod: this run dir has no training_finished
    assert c._step()[1].name == "finished" and c.state.status == RunStatus.SUCCEEDED


def test_too_few_nodes_fails_after_wait_for_nodes(make_controller):
    c, pool, _, clock = make_controller(["cluster.nnodes=2", "failure.wait_for_nodes_s=20"], machines(1))
    assert c._step()[1].name == "scheduling"
    clock.advance(21)
    assert steps(c, 2)[-1] == "failed"
    assert "only 1 of MIN=2 nodes" in c.state.reason


def test_max_preemptions_spent_fails_the_run(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=1:2", "failure.max_preemptions=0"], machines(1, 1))
    steps(c, 2)
    pool.exit(1, -9)
    assert steps(c, 2) == ["stopping", "failed"] and "failure.max_preemptions=0" in c.state.reason


def test_hooks_explain_exits_and_can_end_the_run(make_controller):
    class Hooks(RunHooks):
        fatal = None

        def on_tick(self, agent_pids, rdzv_id):
            self.seen = dict(agent_pids)
            return self.fatal

        def explain_exit(self, node, exit_code, started_t):
            return "cut off by a network partition"

    hooks = Hooks()
    c, pool, events, _ = make_controller(["cluster.nnodes=1:2"], machines(1, 1), hooks=hooks)
    steps(c, 2)
    c._step()
    assert hooks.seen == {0: 1000, 1: 1001}
    pool.exit(1, 1)
    c._step()
    assert events_named(events, "node_lost")[0]["reason"].endswith("cut off by a network partition")
    hooks.fatal = "the hosts are gone"
    assert c._step()[1].name == "failed" and c.state.reason == "the hosts are gone"


def test_losses_after_training_finished_are_not_recovered(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=1:2"], machines(1, 1))
    steps(c, 2)
    events.emit("training_finished", steps_completed=60)
    c._step()
    pool.exit(1, -9)
    pool.exit(0, 0)
    assert c._step()[1].name == "finished" and c.state.status == RunStatus.SUCCEEDED
    assert c.loss_t is None and len(pool.started) == 2


def test_a_user_script_run_ends_when_every_agent_exits_0(make_controller):
    c, pool, events, _ = make_controller(["cluster.nnodes=2", "entrypoint.script=train.py"], machines(1, 1))
    steps(c, 2)
    pool.exit(0, 0)
    pool.exit(1, 0)
    assert c._step()[1].name == "finished" and c.state.status == RunStatus.SUCCEEDED
