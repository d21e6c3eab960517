"""A launch submitted through the Ray Jobs API (``cluster.address=http://HEAD:DASHBOARD``) to a real
``ray start --head`` cluster, then ``orch status``/``orch logs``/``orch stop`` on it (docs/lifecycle.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from orchproc import REPO, orch_env, read_jsonl, run_orch, stop_tree, wait_for

SLOW = ["model._target_=testmodels.SlowMLM", "+model.delay_s=0.03"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A Ray head of this test's own: its own short temp dir (Unix socket paths are short), free ports, the
    dashboard on. Ended by PID: ``ray start --block``'s process tree, then any process naming its temp dir."""
    import psutil

    temp = tempfile.mkdtemp(prefix="orchray", dir="/tmp")
    ports = {name: free_port() for name in ("port", "dashboard-port", "ray-client-server-port", "node-manager-port",
                                            "object-manager-port", "dashboard-agent-listen-port",
                                            "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")}
    env = orch_env({"PATH": f"{Path(os.sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"})  # no token written to ~/.ray
    env.pop("RAY_ADDRESS", None)
    argv = [str(Path(os.sys.executable).parent / "ray"), "start", "--head", "--block", f"--temp-dir={temp}",
            "--num-cpus=4", "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1",
            "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats",
            *(f"--{name}={port}" for name, port in ports.items())]
    log = open(Path(temp) / "ray-start.log", "w")
    head = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"

    def ready() -> bool:
        assert head.poll() is None, (Path(temp) / "ray-start.log").read_text()[-3000:]
        from urllib.request import urlopen

        try:
            with urlopen(f"{url}/api/version", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    try:
        wait_for(ready, 90, "the Ray head's dashboard", interval=1.0)
        yield url, env
    finally:
        stop_tree(head.pid)
        for process in psutil.process_iter(["pid", "cmdline"]):
            if any(temp in part for part in process.info["cmdline"] or ()):
                stop_tree(process.info["pid"])
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_jobs_launch_logs_and_stop(ray_head, tmp_path):
    url, env = ray_head
    run_dir = tmp_path / "run"
    submitted = run_orch("launch", "conf=cpu_gloo", "trainer.max_steps=400", *SLOW, "cluster.placement=pack",
                         f"cluster.address={url}", f"run.dir={run_dir}", "--detach", env=env, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert f"submitted Ray job cpu-gloo-" in submitted.stdout and f"run dir: {run_dir}" in submitted.stdout
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["mode"] == "ray_job" and record["ray_job"]["address"] == url
    assert f"cluster.address={url}" in record["overrides"]  # resume submits to the same cluster

    def training() -> bool:
        status = run_orch("status", str(run_dir), env=env, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr + _job_logs(run_dir, env)
        return "state:       running" in status.stdout and any(m["step"] >= 5 for m in read_jsonl(run_dir / "metrics.jsonl"))

    wait_for(training, 180, "the Ray job to train", interval=2.0)
    logs = run_orch("logs", str(run_dir), env=env, timeout=60)
    assert logs.returncode == 0 and " rank0] step " in logs.stdout, logs.stderr  # [nodeN rank0] step ...

    stopped = run_orch("stop", str(run_dir), env=env, timeout=200)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr + _job_logs(run_dir, env)
    assert "stopped at step" in stopped.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps_completed"] < 400
    assert any(e["event"] == "emergency_checkpoint" for e in read_jsonl(run_dir / "events.jsonl"))


def _job_logs(run_dir: Path, env: dict) -> str:
    out = run_orch("logs", str(run_dir), env=env, timeout=60)
    return out.stdout[-3000:] + out.stderr
