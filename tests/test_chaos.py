"""`orch chaos` acts only on a live run's own agents: a finished run, a reused PID, another run's agent or a
malformed nodes.json is refused with one line and exit 2, and nothing is signalled. The tests with real processes
to signal (or to leave alone) are slow; a malformed nodes.json needs none."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from orchproc import orch_here, run_orch
from orchestrator.rundir import EventLog

pytestmark = pytest.mark.timeout(60)

# argv of a fake torchrun agent: `python -c CODE -m torch.distributed.run --rdzv-id=RID ...` (only the argv
# and environment matter to chaos; it just sleeps).
FAKE_AGENT = "import time; time.sleep(30)"


def _run_dir(tmp_path, pids, finished=False, run_id="rid123"):
    events = EventLog(tmp_path)
    events.emit("launch_started", run_id=run_id, launcher="local", nodes=len(pids))
    if finished:
        events.emit("run_finished", status="succeeded")
    (tmp_path / "nodes.json").write_text(json.dumps({str(n): p for n, p in enumerate(pids)}))
    return tmp_path


def _fake_agent(*args, env=None):
    return subprocess.Popen([sys.executable, "-c", FAKE_AGENT, "-m", "torch.distributed.run", *args], env=env)


def _end(proc):
    proc.kill()
    proc.wait(timeout=5)


def _one_line_exit_2(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_finished_run_is_refused_and_a_reused_pid_survives(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        run_dir = _run_dir(tmp_path, [sleeper.pid], finished=True)
        for cmd in (["kill-node"], ["preempt", "--grace", "1"]):
            r = run_orch("chaos", *cmd, str(run_dir), "--node", "0", timeout=30)
            _one_line_exit_2(r)
            assert "already finished" in r.stderr and str(run_dir) in r.stderr and "Fix:" in r.stderr
        assert sleeper.poll() is None, "an unrelated process listed by a finished run was signalled"
        assert [e["event"] for e in EventLog(run_dir).read()] == ["launch_started", "run_finished"]
    finally:
        _end(sleeper)


@pytest.mark.slow
def test_a_live_run_whose_pid_is_not_its_agent_is_refused(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    other = _fake_agent("--rdzv-id=otherrun")
    try:
        run_dir = _run_dir(tmp_path, [sleeper.pid, other.pid])
        r = run_orch("chaos", "kill-node", str(run_dir), "--node", "0", timeout=30)
        _one_line_exit_2(r)
        assert f"pid {sleeper.pid}" in r.stderr and "not a torchrun agent" in r.stderr and "--node 0" in r.stderr
        r = run_orch("chaos", "kill-node", str(run_dir), "--node", "1", timeout=30)
        _one_line_exit_2(r)
        assert "agent of another run" in r.stderr
        assert sleeper.poll() is None and other.poll() is None
    finally:
        _end(sleeper)
        _end(other)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"zero": 5}', '{"0": "abc"}', '{"0": -4}'])
def test_malformed_nodes_json_is_one_line_exit_2(tmp_path, capsys, content):
    _run_dir(tmp_path, [])
    (tmp_path / "nodes.json").write_text(content)
    r = orch_here(capsys, "chaos", "kill-node", str(tmp_path), "--node", "0")
    _one_line_exit_2(r)
    assert "nodes.json is malformed" in r.stderr


@pytest.mark.slow
def test_a_live_agent_of_the_run_is_killed(tmp_path):
    by_rdzv_id = _fake_agent("--rdzv-id=rid123-2", "--nnodes=1:2")
    by_env = _fake_agent("--rdzv-id=somethingelse", env={"ORCH_RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    try:
        time.sleep(0.2)  # both have exec'd python with their argv
        run_dir = _run_dir(tmp_path, [by_rdzv_id.pid, by_env.pid])
        for node, proc in enumerate((by_rdzv_id, by_env)):
            r = run_orch("chaos", "kill-node", str(run_dir), "--node", str(node), timeout=30)
            assert r.returncode == 0, r.stderr
            assert proc.wait(timeout=5) == -9
        kills = [e for e in EventLog(run_dir).read() if e["event"] == "chaos_kill"]
        assert [(e["node"], e["pids"]) for e in kills] == [(0, [by_rdzv_id.pid]), (1, [by_env.pid])]
    finally:
        _end(by_rdzv_id)
        _end(by_env)
