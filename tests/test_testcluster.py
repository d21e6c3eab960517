"""Test clusters themselves: naming and planning (pure), and real namespaces: up, status, reachability by
name, partition/heal/kill, and a `down` that leaves nothing behind (slow: `ip` and the processes inside the
namespaces are real). Launches on a cluster are in test_testcluster_launch.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from orchproc import orch_here, run_orch
from orchestrator.testcluster import netns as nx
from orchestrator.testcluster.cluster import HOSTS_FILE, faults, leftovers
from orchestrator.testcluster.state import load_state, plan_cluster, state_path

pytestmark = pytest.mark.timeout(120)

SERVER = ("import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
          "s.bind(('0.0.0.0', 29555)); s.listen(8); print('listening', flush=True)\n"
          "while True:\n c, a = s.accept(); c.sendall(a[0].encode()); c.close()")
CLIENT = ("import socket,sys\ntry:\n c = socket.create_connection((sys.argv[1], 29555), timeout=float(sys.argv[2]))\n"
          " print('reached', c.recv(64).decode(), c.getsockname()[0])\nexcept OSError as e:\n print('unreachable', e)")


@pytest.fixture
def netns_allowed():
    """For tests that make their own clusters through the CLI: skip where the fixture would skip."""
    from orchestrator.testcluster.pytest_plugin import testcluster_unavailable

    reason = testcluster_unavailable()
    if reason:
        pytest.skip(f"testcluster: {reason}")


def test_cluster_plan_names_hosts_and_addresses():
    state = plan_cluster("ci", 3, subnet_index=77)
    assert [n.address for n in state.nodes] == ["10.213.77.10", "10.213.77.11", "10.213.77.12"]
    assert [n.hostname for n in state.nodes] == ["ci-node0", "ci-node1", "ci-node2"]
    assert state.bridge_address == "10.213.77.1" and len(state.bridge) <= 15
    assert all(len(n.host_link) <= 15 for n in state.nodes), "Linux link names are at most 15 characters"
    hosts = state.hosts_file()
    assert "10.213.77.1\tci-host" in hosts and "10.213.77.12\tci-node2" in hosts
    assert "::ffff:10.213.77.11\tci-node1" in hosts, "c10d reverse-resolves IPv4-mapped addresses"


def test_plan_runs_each_node_in_its_namespace_with_its_own_address():
    """Planning stays pure: the test-cluster site's host records go in (what the cluster's state says of
    each host), per node command, env and host come out; the plan itself knows nothing of test clusters."""
    from launchers.testcluster import host_records
    from orchestrator.config.compose import compose_config
    from orchestrator.plan.plan import build_plan

    state = plan_cluster("ci", 3, subnet_index=77)
    cfg = compose_config("cpu_elastic", ["launcher=local", "cluster.nnodes=2:3", "cluster.testcluster=ci"])
    plan = build_plan(cfg, "/tmp/run", "rid", store_port=1234, store_host=state.bridge_address,
                      hosts=host_records(state, 3))
    assert plan.rendezvous_endpoint == "10.213.77.1:1234"
    for node, host in zip(plan.nodes, state.nodes):
        assert f"--local-addr={host.hostname}" in node.argv
        assert node.env["GLOO_SOCKET_IFNAME"] == "eth0" and node.host.address == host.address
        entered = node.host.run(node.argv)
        assert entered[:4] == ("ip", "netns", "exec", host.netns) and entered[-len(node.argv):] == node.argv
    assert f"host: ci-node1 at {state.nodes[1].address}" in plan.format_text()
    assert "ip netns exec orch-ci-node1" in plan.format_text()
    plain = build_plan(compose_config("cpu_gloo", []), "/tmp/run", "rid", store_port=1234)
    assert all(n.host is None and "--local-addr" not in " ".join(n.argv) for n in plain.nodes)


def test_bad_names_and_missing_clusters_exit_2(capsys):
    r = orch_here(capsys, "launch", "conf=cpu_gloo", "launcher=local", "cluster.testcluster=Bad_Name", "--dry-run")
    assert r.returncode == 2 and "cluster.testcluster='Bad_Name'" in r.stderr
    r = orch_here(capsys, "launch", "conf=cpu_gloo", "launcher=local", "cluster.testcluster=nosuchcluster", "--dry-run")
    assert r.returncode == 2 and "no test cluster named 'nosuchcluster' is up" in r.stderr
    assert r.stderr.count("\n") == 1, "one line, no traceback"
    r = orch_here(capsys, "launch", "conf=cpu_gloo", "launcher=ray", "cluster.testcluster=ci", "cluster.address=auto",
                  "--dry-run")
    assert r.returncode == 2 and "cluster.testcluster='ci' cannot join another Ray cluster" in r.stderr


def test_commands_that_change_the_network_need_root(monkeypatch, capsys):
    from orchestrator.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["testcluster", "up", "--nodes", "2", "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert "orch testcluster up needs root" in err and "Fix: run it with sudo" in err and err.count("\n") == 1


@pytest.mark.slow
def test_pytest_plugin_is_opt_in(tmp_path):
    from importlib.metadata import entry_points

    assert "orch_testcluster" not in {ep.name for ep in entry_points(group="pytest11")}, "not auto-loaded"
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")

    def fixtures(*flags):
        return subprocess.run([sys.executable, "-m", "pytest", "--fixtures", "-p", "no:cacheprovider", *flags,
                               str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=60).stdout

    assert "testcluster" not in fixtures()
    assert "testcluster" in fixtures("-p", "orch_testcluster")


@pytest.mark.slow
@pytest.mark.testcluster(nodes=3)
def test_hosts_reach_each_other_by_name_and_faults_cut_them_off(testcluster):
    tc = testcluster
    server = subprocess.Popen(["ip", "netns", "exec", tc.netns[2], sys.executable, "-c", SERVER],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        # node0 reaches node2 by hostname; node2 sees node0's own address (no NAT, no loopback).
        out = tc.run(0, sys.executable, "-c", CLIENT, tc.hostnames[2], "3").stdout.split()
        assert out == ["reached", tc.addresses[0], tc.addresses[0]]
        assert tc.run(1, "hostname", "-I").stdout.split() == [tc.addresses[1]]
        # The host namespace resolves every node from files: c10d's reverse lookups never reach a DNS server.
        for host, addr in zip(tc.hostnames, tc.addresses):
            assert socket.getnameinfo((f"::ffff:{addr}", 0, 0, 0), socket.NI_NAMEREQD)[0] == host
        assert tc.pids(2) == [server.pid]

        tc.partition(2)
        assert tc.status()["nodes"][2]["link"].startswith("down")
        assert "unreachable" in tc.run(0, sys.executable, "-c", CLIENT, tc.hostnames[2], "1").stdout
        assert server.poll() is None and tc.pids(2) == [server.pid], "a partitioned host's processes keep running"

        tc.heal(2)
        deadline = time.monotonic() + 10
        while "reached" not in tc.run(0, sys.executable, "-c", CLIENT, tc.hostnames[2], "1").stdout:
            assert time.monotonic() < deadline, "node2 unreachable after heal"

        killed = tc.kill(2)
        assert killed["pids"] == [server.pid] and server.wait(timeout=5) == -9 and tc.pids(2) == []
        assert [f["fault"] for f in faults(tc.name)] == ["partition", "heal", "kill"]
    finally:
        server.kill()


@pytest.mark.slow
def test_cli_up_status_down_leaves_nothing_behind(netns_allowed):
    name = f"cli{os.getpid() % 10000}"
    try:
        r = run_orch("testcluster", "up", "--nodes", "2", "--name", name)
        assert r.returncode == 0, r.stderr
        assert f"{name}-node1" in r.stdout and f"cluster.testcluster={name}" in r.stdout
        state = load_state(name)
        r = run_orch("testcluster", "status", name, "--json")
        info = json.loads(r.stdout)
        assert [n["link"] for n in info["nodes"]] == ["up", "up"] and info["bridge_exists"]
        # A process left running inside a node (a stale agent) must not survive `down`.
        sleeper = subprocess.Popen(["ip", "netns", "exec", state.nodes[1].netns, "sleep", "300"])
        time.sleep(0.3)
        r = run_orch("testcluster", "down", name)
        assert r.returncode == 0, r.stderr
        assert "1 process(es) killed" in r.stdout
        assert sleeper.wait(timeout=5) == -9
        assert leftovers(name) == []
        assert not any(ns.startswith(f"orch-{name}-") for ns in nx.list_netns())
        assert state.bridge not in nx.links() and not any(n.host_link in nx.links() for n in state.nodes)
        assert name not in HOSTS_FILE.read_text()
        r = run_orch("testcluster", "status", name)
        assert r.returncode == 2 and "no test cluster named" in r.stderr
    finally:
        run_orch("testcluster", "down", name)


@pytest.mark.slow
def test_up_replaces_the_leftovers_of_a_crashed_cluster(netns_allowed):
    name = f"crash{os.getpid() % 10000}"
    try:
        assert run_orch("testcluster", "up", "--nodes", "3", "--name", name).returncode == 0
        old = load_state(name)
        sleeper = subprocess.Popen(["ip", "netns", "exec", old.nodes[2].netns, "sleep", "300"])
        time.sleep(0.3)
        # A crash: the state file is gone, namespaces, links and a process are not.
        state_path(name).unlink()
        r = run_orch("testcluster", "up", "--nodes", "2", "--name", name)
        assert r.returncode == 0, r.stderr
        assert sleeper.wait(timeout=5) == -9
        assert sorted(ns for ns in nx.list_netns() if ns.startswith(f"orch-{name}-")) == [
            f"orch-{name}-node0", f"orch-{name}-node1"]
        assert HOSTS_FILE.read_text().count(f"# BEGIN orch testcluster {name}") == 1
    finally:
        run_orch("testcluster", "down", name)
    assert leftovers(name) == []


@pytest.mark.slow
@pytest.mark.testcluster(nodes=2)
def test_a_cut_off_node_whose_agent_gave_up_gets_a_fresh_agent_once_healed(testcluster, tmp_path):
    """The launcher side of a partition, without a job: a cut-off node's agent that exits non-zero is lost (not
    failed), and its node is handed back for a fresh agent only once its link is up again."""
    from orchestrator.config.schema import RendezvousConfig
    from orchestrator.rendezvous import RendezvousStore
    from orchestrator.rundir import EventLog
    from orchestrator.testcluster.watch import ClusterWatch

    store = RendezvousStore(testcluster.store_address, secret="test-cluster-secret")
    events, t0 = EventLog(tmp_path), time.time()
    watch = ClusterWatch(testcluster.state, str(tmp_path), "rid", events, RendezvousConfig(), since=t0, store=store)

    def tick():
        watch._next_poll = 0.0
        return watch.poll({}, lambda node: False)

    try:
        assert watch.exit_reason(1, 1, t0) is None, "no partition: an agent exiting 1 is a failure"
        testcluster.partition(1)
        assert watch.exit_reason(1, 1, t0) == "cut off by a network partition (agent exited with code 1)"
        assert tick() == []
        testcluster.heal(1)
        assert tick() == [1] and tick() == []
        assert [(e["event"], e["node"]) for e in events.read()] == [("chaos_partition", 1), ("chaos_heal", 1)]
    finally:
        watch.close()
        store.close()


def test_fixture_skips_with_one_line_where_namespaces_are_not_allowed(monkeypatch):
    from orchestrator.testcluster import pytest_plugin

    monkeypatch.setattr(pytest_plugin, "_probe_result", [])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = pytest_plugin.testcluster_unavailable()
    assert reason.startswith("the testcluster fixture needs root") and "\n" not in reason


def _crafted_state(tmp_path, name, netns):
    """A state file for cluster ``name`` in ``tmp_path`` (the state dir) whose node 0 names ``netns``."""
    state = json.loads(plan_cluster(name, 2, subnet_index=91).to_json())
    state["nodes"][0]["netns"] = netns
    (tmp_path / f"{name}.json").write_text(json.dumps(state))


@pytest.mark.parametrize("bad", ["{victim}", "../..{victim}", "orch-evil-node0/../..{victim}", "orch-other-node0",
                                 "orch-evil-node0x"])
def test_a_state_file_naming_what_the_cluster_does_not_own_is_refused(tmp_path, monkeypatch, bad):
    """Pure (no root): the state is checked when it is read, before `down`/`up` touch anything it names."""
    from orchestrator.errors import UserError
    from orchestrator.testcluster.state import STATE_DIR_ENV

    victim = tmp_path / "victim"
    victim.mkdir()
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    _crafted_state(tmp_path, "evil", bad.format(victim=victim))
    with pytest.raises(UserError, match="never creates: refusing to remove or change anything"):
        load_state("evil")
    for escaping in (str(victim), "../tmp", "..", ""):
        with pytest.raises(nx.NetnsError, match="would escape /etc/netns"):
            nx.netns_etc_dir(escaping)


def test_a_malformed_state_file_is_one_user_error(tmp_path, monkeypatch):
    from orchestrator.errors import UserError
    from orchestrator.testcluster.state import STATE_DIR_ENV

    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    for text in ("{not json", '{"name": "evil"}', '{"name": "evil", "nodes": 3}'):
        (tmp_path / "evil.json").write_text(text)
        with pytest.raises(UserError, match="is malformed") as info:
            load_state("evil")
        assert "\n" not in str(info.value)


def test_down_refuses_a_state_file_whose_paths_escape_etc_netns(tmp_path, monkeypatch, capsys):
    """`down` deletes what a state file names: one naming an absolute path or `..` is refused whole, with one
    line and exit 2, and the path it names is still there. It is refused before anything runs: no namespaces
    are needed, only root (which `down` asks for first)."""
    from orchestrator.testcluster.state import STATE_DIR_ENV

    if os.geteuid() != 0:
        pytest.skip("orch testcluster down needs root")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious\n")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    monkeypatch.setenv(STATE_DIR_ENV, str(state_dir))
    for bad in (str(victim), "../.." + str(victim)):
        _crafted_state(state_dir, "evil", bad)
        r = orch_here(capsys, "testcluster", "down", "evil")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"names network namespace {bad!r}" in r.stderr and "Fix:" in r.stderr
        assert (victim / "keep").read_text() == "precious\n"
        assert (state_dir / "evil.json").exists(), "a refused state file is left for a human to inspect"


@pytest.mark.slow
def test_up_and_down_rewrite_etc_hosts_atomically_and_restore_it(netns_allowed, tmp_path):
    name = f"hosts{os.getpid() % 10000}"
    env = {"ORCH_TESTCLUSTER_DIR": str(tmp_path)}
    before, inode = HOSTS_FILE.read_text(), HOSTS_FILE.stat().st_ino
    try:
        r = run_orch("testcluster", "up", "--nodes", "1", "--name", name, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert HOSTS_FILE.stat().st_ino != inode, "renamed over, not written in place"
        assert f"# BEGIN orch testcluster {name}" in HOSTS_FILE.read_text()
        backup = tmp_path / f"{name}.hosts.bak"
        assert backup.read_text() == before, "the previous /etc/hosts is kept next to the state file"
        assert not list(HOSTS_FILE.parent.glob(".hosts.orch-*")), "no temporary file left in /etc"
        r = run_orch("testcluster", "down", name, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert HOSTS_FILE.read_text() == before and not backup.exists()
    finally:
        run_orch("testcluster", "down", name, env=env, timeout=60)
