"""The Ray launcher for real: `orch launch` as users run it, on the embedded Ray and on a multi-node Ray cluster
on this machine (``ray.cluster_utils.Cluster``: a head with no CPUs and three 1-CPU nodes, so each node agent
gets a Ray node of its own), with real torchrun agents and gloo workers. Nodes are lost by removing their Ray
node, and gained by adding one. All slow but an unreachable cluster address, refused before anything starts
(the CLI's main in this process).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchproc import orch_here, read_jsonl, run_orch, start_orch, stop_launch, stop_tree, summary, wait_for

WORKER_NODES = 3


def events_of(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def stop_run(proc, run_dir: Path) -> None:
    """End orch's process tree, then any node agent that outlived it (on cluster nodes they are not its children)."""
    from orchestrator.processes import kill_tree

    stop_tree(proc.pid)
    for joined in events_of(run_dir, "node_joined"):
        kill_tree(joined["pid"])


@pytest.mark.timeout(60)
def test_unreachable_cluster_address_exits_2_in_seconds_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = orch_here(capsys, "launch", "conf=cpu_gloo", "launcher=ray", "cluster.address=127.0.0.1:1",
                       f"run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("orch: error: cluster.address='127.0.0.1:1': no Ray cluster answers"), lines
    assert "Fix:" in lines[-1] and "Traceback" not in result.stderr
    assert time.monotonic() - started < 45, "must fail fast, not after Ray's minutes of retries"
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_embedded_ray_runs_cpu_gloo(tmp_path):
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", "launcher=ray", "trainer.max_steps=20", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 20 and s["world_size_history"] == [2]
    started = events_of(run_dir, "launch_started")[0]
    assert started["launcher"] == "ray" and started["ray"] == "embedded" and started["placement"] == "pack"
    assert not started["rendezvous_endpoint"].startswith("127."), "agents dial the driver node's IP"
    assert sorted(e["node"] for e in events_of(run_dir, "node_joined")) == [0, 1]
    states = [(e["previous"], e["state"]) for e in events_of(run_dir, "controller_state")]
    assert states == [("scheduling", "running"), ("running", "finished")]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert all("is_host=false" in a for n in plan["nodes"] for a in n["argv"] if a.startswith("--rdzv-conf"))
    for name in ("logs/node0.log", "logs/node1.log", "nodes.json", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).exists(), name
    assert "[node1 rank" in result.stdout or "[node0 rank" in result.stdout, result.stdout[-2000:]


@pytest.fixture(scope="module")
def ray_cluster():
    """A head (no CPUs: no agent lands there) and three 1-CPU worker nodes, shared by the tests below; each
    test leaves it with three worker nodes again."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(WORKER_NODES):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def cluster(ray_cluster):
    """The shared cluster, topped up to three worker nodes again after the test, whatever happened in it."""
    yield ray_cluster
    missing = WORKER_NODES - (len(ray_cluster.list_all_nodes()) - 1)
    for _ in range(missing):
        ray_cluster.add_node(num_cpus=1)
    if missing > 0:
        ray_cluster.wait_for_nodes()


def cluster_node(cluster, node_id: str):
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def timeline(run_dir: Path) -> str:
    """The controller's story of a run, for assertion messages."""
    keep = ("node_joined", "node_lost", "node_preempted", "node_failed", "node_finished", "rendezvous_complete",
            "recovered", "controller_state", "training_finished", "run_finished")
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] in keep]
    t0 = events[0]["t"] if events else 0
    return "\n".join(f"{e['t'] - t0:7.2f} {e['event']} " + " ".join(f"{k}={e[k]}" for k in ("node", "world_size", "state", "mttr_s") if k in e)
                     for e in events)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_lost_node_shrinks_the_job_and_a_new_node_grows_it_back(cluster, tmp_path):
    """2..3 nodes: remove the Ray node under node 1 mid-run (the survivors go on at 2), then add a Ray node
    (the controller starts an agent there and the job is back at 3); then ``orch stop`` ends it."""
    run_dir = tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=ray", f"cluster.address={cluster.address}",
                      "cluster.nnodes=2:3", "trainer.max_steps=100000", "trainer.log_every=5", "failure.wait_for_nodes_s=30",
                      f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        wait_for(lambda: any(m["step"] >= 10 for m in read_jsonl(run_dir / "metrics.jsonl")), 180, "step 10")
        joined = {e["node"]: e["ray_node"] for e in events_of(run_dir, "node_joined")}
        assert len(set(joined.values())) == 3, "spread: one agent per Ray node"
        cluster.remove_node(cluster_node(cluster, joined[1]))
        wait_for(lambda: events_of(run_dir, "recovered"), 120, "recovery after the lost node")
        added = cluster.add_node(num_cpus=1)
        grown = wait_for(lambda: [e for e in events_of(run_dir, "node_joined") if e["ray_node"] == added.node_id],
                         60, "an agent on the new node")[0]
        wait_for(lambda: [e for e in events_of(run_dir, "first_step") if e["t"] > grown["t"] and e["world_size"] == 3],
                 120, "training at world size 3 again")
        assert stop_launch(proc) == 0, timeline(run_dir) + (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_run(proc, run_dir)
    s, story = summary(run_dir), timeline(run_dir)
    assert s["status"] == "stopped", story
    assert s["world_size_history"][:3] == [3, 2, 3], story
    lost = events_of(run_dir, "node_lost")
    assert [e["node"] for e in lost] == [1] and "Ray node left the cluster" in lost[0]["reason"], story
    assert len(s["recoveries"]) == 1 and 0 < s["recoveries"][0]["mttr_s"] < 60
    assert s["recoveries"][0]["world_size"] == 2
    assert not events_of(run_dir, "node_failed"), "a lost node is not a failure"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_user_code_failure_exhausts_max_failures_and_names_the_rank(cluster, tmp_path):
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", "launcher=ray", f"cluster.address={cluster.address}",
                      "trainer.max_steps=12", "cluster.max_restarts=0", "failure.max_failures=1",
                      "model._target_=testmodels.FailingMLM", "+model.fail_rank=1", f"run.dir={run_dir}", timeout=280)
    try:
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        error = result.stderr.strip().splitlines()[-1]
        assert "failure.max_failures=1" in error and "root cause rank 1" in error
        assert "ValueError: deliberate bug in user code" in error
    finally:
        for joined in events_of(run_dir, "node_joined"):
            from orchestrator.processes import kill_tree

            kill_tree(joined["pid"])
    s = summary(run_dir)
    assert s["status"] == "failed" and s["root_cause"]["rank"] == 1
    assert [e["scope"] for e in events_of(run_dir, "restart") if "scope" in e] == ["every node"]
    attempts = {e["rdzv_id"] for e in events_of(run_dir, "node_joined")}
    assert len(attempts) == 2, "the restart used a fresh rendezvous"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_below_min_nodes_for_longer_than_wait_for_nodes_fails_saying_so(cluster, tmp_path):
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", "launcher=ray", f"cluster.address={cluster.address}",
                      "cluster.nnodes=4", "trainer.global_batch_size=32", "failure.wait_for_nodes_s=5",
                      f"run.dir={run_dir}", timeout=170)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "only 3 of MIN=4 nodes" in error and "failure.wait_for_nodes_s=5" in error
    # At most the 3 nodes the cluster has joined (on a loaded machine their actors may not all have started
    # within the 5 s the run waits).
    assert len(events_of(run_dir, "node_joined")) <= 3
    assert summary(run_dir)["status"] == "failed"
