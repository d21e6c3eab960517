"""An agent interpreter started ahead (orchestrator/processes.py: WarmInterpreter, orchestrator/rendezvous/warm.py)
becomes the node's agent with the node's command line and environment, is used only where it fits, and ends
when unused; the local launcher's agents start from one."""

from __future__ import annotations

import json
import sys
import time

import pytest

from orchproc import read_jsonl, run_orch
from orchestrator.processes import WarmInterpreter, close_warm
from orchestrator.rendezvous.args import AGENT_MODULE, WARM_MODULE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_it_becomes_the_agent_with_the_nodes_environment_not_the_drivers(monkeypatch):
    monkeypatch.setenv("ORCH_RUN_SECRET", "the-drivers")  # the warm interpreter starts with it
    warm = WarmInterpreter(WARM_MODULE, AGENT_MODULE)
    argv = [sys.executable, "-m", AGENT_MODULE, "--nnodes=1"]
    env = {k: v for k, v in warm.env.items() if k != "ORCH_RUN_SECRET"}
    assert warm.fits(argv, env)
    proc = warm.become(argv, env)
    out = proc.stdout.read()  # as the pool's pump reads it
    assert proc.wait(timeout=60) == 1 and "ORCH_RUN_SECRET is not set" in out, out  # the node's env, without it


def test_it_fits_only_the_agents_command_with_the_same_interpreter_settings(monkeypatch):
    warm = WarmInterpreter(WARM_MODULE, AGENT_MODULE)
    try:
        agent = [sys.executable, "-m", AGENT_MODULE, "--nnodes=1"]
        assert warm.fits(agent, {**warm.env, "PYTHONPATH": "/elsewhere", "ORCH_NODE": "3"})
        assert not warm.fits(["/usr/bin/python3", *agent[1:]], warm.env), "another interpreter"
        assert not warm.fits([sys.executable, "-m", "torch.distributed.run"], warm.env), "another module"
        assert not warm.fits(agent, {**warm.env, "PYTHONHASHSEED": "7"}), "read at the interpreter's start"
        assert not warm.fits(agent, {k: v for k, v in warm.env.items() if k != "PYTHONUNBUFFERED"})
    finally:
        pool = [warm]
        close_warm(pool)
    assert pool == [] and warm.proc.returncode is not None, "an unused one is ended"
    assert not warm.fits(agent, warm.env), "nor does an ended one"


def test_the_local_launchers_agent_interpreter_starts_before_the_launch_does(tmp_path):
    """The node's agent interpreter began before the launch was logged (it imported torch's agent while the
    driver made the store, the run dir and the plan; a fresh one starts after), and the run is what it was."""
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", "launcher=local", "cluster.nnodes=1", "cluster.nproc_per_node=2",
                      "trainer.max_steps=6", "checkpoint.every_n_steps=0", f"run.dir={run_dir}", timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    events = read_jsonl(run_dir / "events.jsonl")
    launched = next(e for e in events if e["event"] == "launch_started")
    worker = next(e for e in events if e["event"] == "worker_started")
    assert worker["agent_start_t"] < launched["t"], (worker["agent_start_t"], launched["t"])
    assert json.loads((run_dir / "summary.json").read_text())["steps_completed"] == 6


def test_orch_chaos_knows_an_agent_from_a_warm_interpreter_by_its_parent_the_runs_supervisor(tmp_path):
    """Its command line came on its stdin, so /proc shows only the warm module: it is the run's agent when its
    parent is the supervisor launch.json names (PID and start time), and another run's otherwise."""
    import os

    from orchestrator.chaos import _agent_mismatch
    from orchestrator.launch_record import supervisor
    from orchestrator.rundir import LAUNCH_FILE

    import psutil

    warm = WarmInterpreter(WARM_MODULE, AGENT_MODULE)
    try:
        deadline = time.monotonic() + 30  # forked, not yet exec'd: /proc shows this process's command line
        while WARM_MODULE not in psutil.Process(warm.proc.pid).cmdline() and time.monotonic() < deadline:
            time.sleep(0.02)
        record = tmp_path / LAUNCH_FILE
        record.write_text(json.dumps({"run_id": "r1", "supervisor": supervisor()}))  # this test started it
        assert _agent_mismatch(warm.proc.pid, str(tmp_path), "r1") is None
        record.write_text(json.dumps({"run_id": "r1", "supervisor": {**supervisor(), "create_time": 1.0}}))
        assert "another run" in _agent_mismatch(warm.proc.pid, str(tmp_path), "r1"), "a reused PID is not it"
        record.write_text(json.dumps({"run_id": "r1", "supervisor": supervisor(os.getppid())}))
        assert "another run" in _agent_mismatch(warm.proc.pid, str(tmp_path), "r1")
    finally:
        close_warm([warm])
