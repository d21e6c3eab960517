"""Recovery that cannot get stuck: a node that joins a scale-up round and dies before its first step.

The round it joined is complete, so torch's own agents never re-rendezvous for it: the survivors' fresh workers
wait for its rank in process-group setup until ``backend.timeout_s`` (30 minutes; a run was seen stuck 12
minutes). orch's store evicts the departed agent and reopens the round (orchestrator/rendezvous/state.py), and
the survivors' torchrun agents rejoin within seconds. Checked twice: with real torchrun agents the test starts
itself against orch's store (what the launchers do on a lost node, done by hand), and end to end through
``orch launch``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchproc import read_jsonl, start_orch, stop_tree, summary, wait_for

pytestmark = pytest.mark.slow

MAX_STEPS = 600
"""Long enough that the drill (about 150 steps here) ends well before training does."""
RECOVERY_BOUND_S = 30.0
"""Survivors train again this soon after the joiner died: orch's usual recovery (about 7 s on an idle machine
of this size, 20 s with other test suites sharing its two cores). Without the reopen they waited for
backend.timeout_s: 30 minutes (a run was seen stuck for 12)."""


WORKER = r'''
import json, os, sys, time
import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")  # where a broken round's survivors wait for a rank that never comes
step = 0
while True:
    stop = torch.tensor([float(os.path.exists(os.path.join(out, "stop")))])
    dist.all_reduce(stop)  # every rank agrees on the step to stop at
    if stop.item():
        break
    step += 1
    line = {"t": time.time(), "agent": os.getppid(), "rank": dist.get_rank(), "world": dist.get_world_size(),
            "step": step}
    with open(os.path.join(out, "steps.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
    time.sleep(0.2)
dist.destroy_process_group()
'''


def start_agent(store, run_id: str, script: Path, out: Path, logs: Path, name: str) -> subprocess.Popen:
    """A torchrun agent as orch's plan starts one: orch's rendezvous flags and environment, ``--nnodes=2:3``."""
    from orchestrator.config import compose_config
    from orchestrator.rendezvous.args import rendezvous_argv, rendezvous_conf, rendezvous_env

    cfg = compose_config("cpu_elastic", ["launcher=local"])
    argv = [sys.executable, "-m", "orchestrator.rendezvous.agent", "--nnodes=2:3", "--nproc-per-node=1",
            *rendezvous_argv(f"127.0.0.1:{store.port}", run_id, rendezvous_conf(cfg)), "--max-restarts=3",
            "--monitor-interval=0.5",
            str(script), str(out)]
    env = {**os.environ, **rendezvous_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "ORCH_RUN_SECRET": store.secret}
    return subprocess.Popen(argv, env=env, stdout=(logs / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def has_workers(pid: int) -> bool:
    """Its agent started its workers: it wrote its rank info to the round's store and spawned them; they are
    still importing torch, seconds away from their first step."""
    try:
        return bool(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return False


def in_complete_round(client, run_id: str, pid: int, secret: str | None = None) -> bool:
    from orchestrator.rendezvous.state import read_state

    state = read_state(client, run_id, secret)
    return bool(state and state.complete and pid in {m.pid for m in state.participants})


@pytest.mark.timeout(240)
def test_survivors_rejoin_at_once_when_the_joiner_of_a_complete_round_dies(tmp_path):
    """Two torchrun agents train; a third joins, the three form a round, and the joiner is SIGKILLed as soon as
    its workers start. Evicting it (as orch's launchers do for a lost node) reopens the round: the survivors'
    agents restart their workers for the waiting nodes and train at world size 2 within the bound."""
    from orchestrator.processes import kill_tree
    from orchestrator.rendezvous import RendezvousStore

    script, out, logs = tmp_path / "worker.py", tmp_path / "out", tmp_path / "logs"
    script.write_text(WORKER)
    out.mkdir()
    logs.mkdir()
    steps = out / "steps.jsonl"
    store = RendezvousStore(secret="recovery-test-secret")
    client = store.client()
    agents: list[subprocess.Popen] = []
    try:
        agents += [start_agent(store, "recovery", script, out, logs, f"agent{i}") for i in (0, 1)]
        wait_for(lambda: {s["world"] for s in read_jsonl(steps)[-4:]} == {2}, 120, "two agents training")

        joiner = start_agent(store, "recovery", script, out, logs, "joiner")
        agents.append(joiner)
        wait_for(lambda: in_complete_round(client, "recovery", joiner.pid, store.secret) and has_workers(joiner.pid), 90,
                 "a round of three with the joiner's workers starting", interval=0.02)
        kill_tree(joiner.pid)
        killed_t = time.time()
        eviction = store.evict("recovery", joiner.pid)
        assert eviction and eviction.reopened, f"the joiner's complete round is reopened: {eviction}"
        assert not any(s["world"] == 3 for s in read_jsonl(steps)), "the joiner died before the round's first step"

        def trained_again():
            after = [s for s in read_jsonl(steps) if s["t"] > killed_t and s["world"] == 2]
            return {s["rank"] for s in after} == {0, 1} and after

        after = wait_for(trained_again, RECOVERY_BOUND_S + 10, "the survivors to train again")
        recovery_s = min(s["t"] for s in after) - killed_t
        assert recovery_s < RECOVERY_BOUND_S, f"survivors trained again {recovery_s:.1f} s after the joiner died"
        assert {s["agent"] for s in after} == {agents[0].pid, agents[1].pid}

        (out / "stop").touch()
        for agent in agents[:2]:
            assert agent.wait(timeout=60) == 0, (logs / "agent0.log").read_text()[-3000:]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
            agent.wait(timeout=10)
        store.close()


def events_after(run_dir: Path, t: float, event: str, **match) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl")
            if e["t"] > t and e["event"] == event and all(e.get(k) == v for k, v in match.items())]


@pytest.mark.timeout(420)
def test_orch_recovers_at_once_when_a_grown_back_node_dies_before_its_first_step(tmp_path):
    """``orch launch`` with three simulated nodes: kill node 2, the survivors go on, the controller grows node 2
    back, and its replacement dies the moment the round of three has formed and its workers start. orch evicts
    it and reopens that round: the survivors train again within the bound, and the run finishes."""
    from orchestrator.processes import kill_tree
    from orchestrator.rendezvous.agent import store_client

    run_dir, secret = tmp_path / "run", "recovery-test-secret"
    # The test watches the round through the store's gate, as an agent would: with the run's secret.
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:3",
                      f"trainer.max_steps={MAX_STEPS}", "trainer.log_every=1", f"run.dir={run_dir}",
                      log=tmp_path / "orch.log", env={"ORCH_RUN_SECRET": secret})
    relay = None
    metrics = run_dir / "metrics.jsonl"

    def steps_since(t: float, world_size: int) -> list[dict]:
        return [m for m in read_jsonl(metrics) if m["t"] > t and m["world_size"] == world_size]

    try:
        wait_for(lambda: any(m["step"] >= 10 for m in read_jsonl(metrics)), 120, "step 10")
        lost_t = time.time()
        kill_tree(json.loads((run_dir / "nodes.json").read_text())["2"])
        # An ordinary loss first: how long this machine, loaded as it is now, takes to recover.
        usual_s = wait_for(lambda: steps_since(lost_t, 2), 120, "recovery from node 2's loss")[0]["t"] - lost_t
        bound_s = max(RECOVERY_BOUND_S, 2 * usual_s)

        joined = wait_for(lambda: events_after(run_dir, lost_t, "node_joined", node=2), 120, "node 2 grown back")[0]
        host, port = json.loads((run_dir / "plan.json").read_text())["rendezvous_endpoint"].rsplit(":", 1)
        client, relay = store_client((host, int(port)), secret)
        wait_for(lambda: in_complete_round(client, joined["rdzv_id"], joined["pid"], secret) and has_workers(joined["pid"]),
                 120, "a round of three with the grown-back node's workers starting", interval=0.02)
        kill_tree(joined["pid"])
        killed_t = time.time()

        again = wait_for(lambda: steps_since(killed_t, 2), bound_s + 30, "the survivors to train again")
        recovery_s = again[0]["t"] - killed_t
        assert recovery_s < bound_s, (f"survivors trained again {recovery_s:.1f} s after the grown-back node died "
                                      f"(an ordinary loss took {usual_s:.1f} s)")
        assert not [m for m in steps_since(joined["t"], 3) if m["t"] <= killed_t], \
            "the grown-back node died before the round's first step"
        assert proc.wait(timeout=240) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
        if relay is not None:
            relay.close()
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == MAX_STEPS
    assert events_after(run_dir, killed_t - 60, "rendezvous_evicted", node=2, agent_pid=joined["pid"])
    assert events_after(run_dir, killed_t - 60, "rendezvous_reopened", node=2)
