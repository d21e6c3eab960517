"""Launches on a test cluster: every simulated node's torchrun agent on its own network-namespace host,
gloo traffic crossing the veth links, a partition survived within the keep-alive timeouts, a healed host
rejoining, and `down` in the middle of a run leaving nothing behind."""

from __future__ import annotations

import json

import psutil
import pytest

from orchproc import read_jsonl, run_orch, start_orch, stop_launch, stop_tree, summary, wait_for
from orchestrator.testcluster import netns as nx
from orchestrator.testcluster.cluster import leftovers

pytestmark = pytest.mark.slow


def lost_ray_node(run_dir, node=2):
    """The Ray node id node ``node``'s first agent joined on."""
    return next(e["ray_node"] for e in events_of(run_dir, "node_joined") if e["node"] == node)


def events_of(run_dir, name, after=0.0):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name and e["t"] > after]


LAUNCHERS = pytest.mark.parametrize("launcher", ["local", "ray"])


@pytest.mark.timeout(360)
@pytest.mark.testcluster(nodes=3)
@LAUNCHERS
def test_cpu_gloo_job_across_three_hosts_binds_each_rank_to_its_host(testcluster, tmp_path, launcher):
    tc, run_dir = testcluster, tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", *tc.launch_overrides(launcher), "cluster.nnodes=3",
                      "trainer.global_batch_size=24", f"run.dir={run_dir}", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 40 and s["world_size_history"] == [3]

    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["rendezvous_endpoint"].startswith(tc.store_address + ":"), "the store listens on the bridge"
    assert [n["host"]["address"] for n in plan["nodes"]] == tc.addresses  # node i on host i
    assert all(netns in n["host"]["wrapper"] for n, netns in zip(plan["nodes"], tc.netns))
    assert all(f"--local-addr={h}" in n["argv"] for n, h in zip(plan["nodes"], tc.hostnames))
    if launcher == "ray":  # node i's agent actor ran on the Ray node that joined from host i's address
        assert {e["node"]: e["ip"] for e in events_of(run_dir, "node_joined")} == dict(enumerate(tc.addresses))
        assert {e["address"] for e in events_of(run_dir, "testcluster_ray_node_started")} == set(tc.addresses)

    # Every rank's TCP sockets (gloo's pairs, the workers' store) are bound to its own host's address, and each
    # reaches the other hosts' addresses: the traffic crossed the veth links, not loopback.
    (bindings,) = events_of(run_dir, "testcluster_bindings")
    assert bindings["own_address_only"], bindings
    ranks = {r["rank"]: r for r in bindings["ranks"]}
    assert sorted(ranks) == [0, 1, 2]
    for r in ranks.values():
        assert r["address"] == tc.addresses[r["node"]] and r["local_addresses"] == [r["address"]]
        assert set(tc.addresses) - {r["address"]} <= set(r["peer_addresses"]), r
    log = (run_dir / "logs" / "testcluster.log").read_text()
    for r in ranks.values():
        assert f"rank {r['rank']} on {r['host']} ({r['address']}): TCP sockets bound to {r['address']};" in log
    print("\n" + log)


@pytest.mark.timeout(540)
@pytest.mark.testcluster(nodes=3)
# local only: detection and recovery run through the store's keep-alives and torchrun, the same under either
# launcher; the Ray launcher on a test cluster is exercised by the host-kill test below (~100 s saved per run).
@pytest.mark.parametrize("launcher", ["local"])
def test_partitioned_host_is_dropped_within_keepalive_timeouts_and_rejoins_when_healed(testcluster, tmp_path, launcher):
    tc, run_dir = testcluster, tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", *tc.launch_overrides(launcher), "cluster.nnodes=2:3", "trainer.max_steps=100000",
                      "trainer.log_every=10", "checkpoint.every_n_steps=20", f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        metrics = lambda: read_jsonl(run_dir / "metrics.jsonl")  # noqa: E731
        wait_for(lambda: any(m["step"] >= 40 and m["world_size"] == 3 for m in metrics()), 180, "step 40 at world size 3")
        cut_off = tc.pids(2)
        cut = tc.partition(2)["t"]

        (broken,) = wait_for(lambda: events_of(run_dir, "round_broken", cut), 60, "the broken round")
        assert broken["silent_hosts"] == [tc.hostnames[2]] and broken["survivors"] == [0, 1]
        assert all(psutil.pid_exists(p) for p in cut_off), "the partitioned host's agent and worker keep running"
        first = wait_for(lambda: [e for e in events_of(run_dir, "first_step", cut) if e["world_size"] == 2],
                         120, "the first step at world size 2")[0]
        wait_for(lambda: any(m["t"] > first["t"] and m["step"] >= first["step"] + 30 for m in metrics()), 120,
                 "30 steps at world size 2")

        healed = tc.heal(2)["t"]
        wait_for(lambda: [e for e in events_of(run_dir, "first_step", healed) if e["world_size"] == 3], 180,
                 "the healed host rejoining at world size 3")
        assert stop_launch(proc) == 0, (tmp_path / "orch.log").read_text()[-3000:]  # the point is made
    finally:
        stop_tree(proc.pid)

    s = summary(run_dir)
    assert s["status"] == "stopped"
    assert s["world_size_history"] == [3, 2, 3]
    # MTTR, from the run dir's own record: the partition event (at the fault's time) to the first step after it.
    (partition,) = events_of(run_dir, "chaos_partition")
    mttr = first["t"] - partition["t"]
    assert partition["node"] == 2 and abs(partition["t"] - cut) < 1e-3
    # Recovery is bounded by the keep-alive timeouts plus a restart, not by the 1800 s collective timeout.
    assert mttr < 90, mttr
    print(f"\nMTTR after a partition: {mttr:.1f} s (detected {broken['t'] - cut:.1f} s after the cut)")

    # The cut-off host's stale workers never came back with an old step: nothing ran at world size 3 between
    # the cut and the rejoin, and the rejoined job restored the newest checkpoint, past every step before heal.
    rejoin = [e for e in events_of(run_dir, "rendezvous_complete", healed) if e["world_size"] == 3][0]
    assert not [m for m in read_jsonl(run_dir / "metrics.jsonl") if cut < m["t"] < rejoin["t"] and m["world_size"] == 3]
    before_heal = max(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["t"] < healed)
    loaded = events_of(run_dir, "checkpoint_loaded", rejoin["t"])[0]
    resumed = events_of(run_dir, "first_step", rejoin["t"])[0]
    assert loaded["world_size"] == 3 and loaded["step"] >= before_heal - 20
    assert resumed["step"] == loaded["step"] + 1 and resumed["world_size"] == 3


@pytest.mark.timeout(300)
@pytest.mark.testcluster(nodes=2)
@pytest.mark.parametrize("launcher", ["local"])  # ray: see docs/testing-in-ci.md, Limits (a Ray call can block)
def test_down_during_a_run_leaves_no_namespace_link_or_process(testcluster, tmp_path, launcher):
    tc, run_dir = testcluster, tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", *tc.launch_overrides(launcher), "cluster.nnodes=1:2",
                      "trainer.max_steps=100000", "failure.wait_for_nodes_s=10", f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        wait_for(lambda: events_of(run_dir, "first_step"), 180, "the first step")
        inside = [p for n in tc.nodes for p in tc.pids(n)]
        agents = list(json.loads((run_dir / "nodes.json").read_text()).values())
        assert set(agents) <= set(inside) and len(inside) >= 4, "agents and workers run inside the namespaces"
        r = run_orch("testcluster", "down", tc.name)
        assert r.returncode == 0, r.stderr
        rc = proc.wait(timeout=120)  # every node is gone: the launch ends (it cannot finish training)
    finally:
        stop_tree(proc.pid)
    gone = lambda p: not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE  # noqa: E731
    assert all(gone(p) for p in inside)
    assert leftovers(tc.name) == []
    assert not [ns for ns in nx.list_netns() if ns in tc.netns]
    assert not [link for link in nx.links() if link in {tc.state.bridge, *(n.host_link for n in tc.state.nodes)}]
    assert rc == 1, (tmp_path / "orch.log").read_text()[-3000:]
    if launcher == "local":
        assert [e["node"] for e in events_of(run_dir, "node_lost")] != []
    else:  # the Ray head listened on the removed bridge: the controller ends the run at once, saying why
        (finished,) = events_of(run_dir, "run_finished")
        assert finished["status"] == "failed" and "was taken down during the run" in finished["reason"]


@pytest.mark.timeout(420)
@pytest.mark.testcluster(nodes=3)
def test_ray_host_killed_is_lost_and_its_ray_node_comes_back_and_the_job_grows_onto_it(testcluster, tmp_path):
    """launcher=ray: every process on a host is killed (its raylet too). Ray declares the node dead, the
    controller counts a lost node and the survivors go on at world size 2; the host's Ray node is started
    again (the machine came back), and the controller grows the job onto it with that host's settings. Then
    ``orch stop`` ends it (the steps left would only add time)."""
    tc, run_dir = testcluster, tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", *tc.launch_overrides("ray"), "cluster.nnodes=2:3",
                      "trainer.max_steps=100000", "trainer.log_every=10", "checkpoint.every_n_steps=20",
                      f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        metrics = lambda: read_jsonl(run_dir / "metrics.jsonl")  # noqa: E731
        wait_for(lambda: any(m["step"] >= 40 and m["world_size"] == 3 for m in metrics()), 240, "step 40 at world size 3")
        killed = tc.kill(2)["t"]
        (lost,) = wait_for(lambda: events_of(run_dir, "node_lost", killed), 90, "node 2 lost")
        assert lost["node"] == 2
        wait_for(lambda: [e for e in events_of(run_dir, "first_step", killed) if e["world_size"] == 2], 120,
                 "the survivors training at world size 2")
        rejoined = wait_for(lambda: [e for e in events_of(run_dir, "node_joined", killed) if e["node"] == 2], 180,
                            "node 2's agent on a new Ray node")[0]
        back = [e for e in events_of(run_dir, "testcluster_ray_node_started", killed) if e["t"] < rejoined["t"]]
        assert back and all(e["node"] == 2 and e["restart"] and e["address"] == tc.addresses[2] for e in back)
        assert rejoined["ip"] == tc.addresses[2] and rejoined["ray_node"] != lost_ray_node(run_dir)
        wait_for(lambda: [e for e in events_of(run_dir, "first_step", rejoined["t"]) if e["world_size"] == 3], 120,
                 "training at world size 3 again")
        assert stop_launch(proc) == 0, (tmp_path / "orch.log").read_text()[-3000:]  # the point is made
    finally:
        stop_tree(proc.pid)
    s = summary(run_dir)
    assert s["status"] == "stopped"
    assert s["world_size_history"] == [3, 2, 3]
    assert s["preemptions"] == 0 and [r["mttr_s"] for r in s["recoveries"]], s["recoveries"]
    assert leftovers(tc.name) == [] or all(not tc.pids(n) for n in tc.nodes), "no Ray node left running on a host"


@pytest.mark.timeout(540)
@pytest.mark.testcluster(nodes=3)
@pytest.mark.skipif(__import__("orchestrator.ft", fromlist=["x"]).torchft_problem() is not None, reason="needs torchft")
def test_per_step_partitioned_host_drops_out_of_the_quorum_and_heals_from_a_peer(testcluster, tmp_path):
    """fault_tolerance.mode=per_step on three hosts: the two survivors go on within seconds without
    restarting; the healed host's replica group comes back by healing from a live peer, not from storage."""
    tc, run_dir = testcluster, tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", *tc.launch_overrides("local"), "cluster.nnodes=1:3",
                      "fault_tolerance.mode=per_step", "trainer.max_steps=100000", "trainer.log_every=5",
                      "checkpoint.every_n_steps=200", f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        wait_for(lambda: [e for e in events_of(run_dir, "quorum_changed") if e["replicas"] == 3], 240,
                 "three replica groups in the quorum")
        cut = tc.partition(2)["t"]
        shrunk = wait_for(lambda: [e for e in events_of(run_dir, "quorum_changed", cut) if e["replicas"] == 2], 60,
                          "the two survivors' next committed step")[0]
        assert shrunk["t"] - cut < 15, shrunk["t"] - cut
        healed = tc.heal(2)["t"]
        back = wait_for(lambda: [e for e in events_of(run_dir, "replica_healed", healed) if e["node"] == 2], 240,
                        "the healed host's group healing from a peer")[0]
        assert back["source_node"] in (0, 1) and back["checkpoint_read"] is False
        assert back["params_sha256"] == back["source_params_sha256"]
        wait_for(lambda: [e for e in events_of(run_dir, "quorum_changed", back["t"]) if e["replicas"] == 3], 60,
                 "three replica groups again")
    finally:
        stop_tree(proc.pid)
    assert not events_of(run_dir, "restart", cut) and not events_of(run_dir, "checkpoint_loaded", cut)
    print(f"\nper_step: survivors committed {shrunk['t'] - cut:.1f} s after the cut; healed host rejoined "
          f"{back['t'] - healed:.1f} s after the heal")
