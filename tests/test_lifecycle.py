"""A run you can walk away from: ``orch launch --detach``, ``orch status``, ``orch logs``, ``orch stop``,
``orch resume`` (docs/lifecycle.md), and the errors for runs that are missing, stale or someone else's."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchproc import ORCH, orch_env, orch_here, read_jsonl, run_orch, stop_tree, unused_pid, wait_for

SLOW = ["model._target_=testmodels.SlowMLM", "+model.delay_s=0.03"]  # 400 steps take long enough to watch


def status_field(out: str, name: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(name + ":"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_detached_launch_survives_its_terminal_then_status_logs_stop_resume(tmp_path, capsys):
    """The launch and its resume are processes of their own (the detached one outlives its terminal); status,
    logs and stop, which read the run dir and signal the detached process, run the CLI's main in this process."""
    run_dir = tmp_path / "run"
    launch = [*ORCH, "launch", "conf=cpu_gloo", "trainer.max_steps=400", *SLOW, f"run.dir={run_dir}", "--detach"]
    # A "terminal": its own session, which launches and then hangs up on its whole process group, as closing a
    # terminal window does. SIGHUP as a terminal's processes have it, whatever this test inherited (under nohup
    # it is ignored, and a shell cannot un-ignore it: the hangup would reach nothing).
    terminal = subprocess.run(["setsid", "bash", "-c", f"{shlex.join(launch)}; kill -HUP -$$"], capture_output=True,
                              text=True, env=orch_env(), timeout=60,
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    pid = json.loads((run_dir / "launch.json").read_text())["supervisor"]["pid"]
    try:
        assert terminal.returncode == -signal.SIGHUP, terminal.stderr  # the terminal died of the hangup
        assert f"run dir: {run_dir}" in terminal.stdout and "run id: cpu-gloo-" in terminal.stdout
        def step() -> int:
            status = orch_here(capsys, "status", str(run_dir))
            assert status.returncode == 0, status.stderr
            state = status_field(status.stdout, "state")
            assert state in ("starting", "running"), status.stdout
            return int(s) if state == "running" and (s := status_field(status.stdout, "step")) != "-" else 0

        first = wait_for(step, 150, "a step in orch status", interval=1.0)
        wait_for(lambda: step() > first, 60, "the step count to grow", interval=1.0)

        logs = orch_here(capsys, "logs", str(run_dir))
        assert logs.returncode == 0 and "[rank0] step " in logs.stdout, logs.stderr
        node_log = orch_here(capsys, "logs", str(run_dir), "--node", "1")
        assert node_log.returncode == 0 and "world size 2" in node_log.stdout, node_log.stderr

        stopped = orch_here(capsys, "stop", str(run_dir))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "stopped at step" in stopped.stdout and "emergency checkpoint at step" in stopped.stdout
        wait_for(lambda: not _alive(pid), 30, "the detached process to exit")
    finally:
        stop_tree(pid)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps_completed"] < 400
    saved = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "emergency_checkpoint"]
    assert saved, "no emergency checkpoint was written"
    again = orch_here(capsys, "stop", str(run_dir))  # a stopped run is not running
    assert again.returncode == 2 and "is not running: it ended stopped" in again.stderr

    resumed = run_orch("resume", str(run_dir), "trainer.log_every=50", timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr
    assert "run succeeded: 400 steps" in resumed.stdout
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["overrides"] == ["trainer.max_steps=400", *SLOW, "trainer.log_every=50"]  # recorded + extra
    events = read_jsonl(run_dir / "events.jsonl")
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == saved[-1]["step"], (loaded, saved)
    status = orch_here(capsys, "status", str(run_dir))
    assert status_field(status.stdout, "state") == "succeeded" and status_field(status.stdout, "step") == "400"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _record(run_dir: Path, **fields) -> None:
    from orchestrator.launch_record import new_record, write_record

    run_dir.mkdir(parents=True)
    write_record(run_dir, {**new_record(str(run_dir), "cpu_gloo-x", "cpu_gloo", ["trainer.max_steps=5"], "detached"),
                           **fields})


def orch(capsys, *argv: str) -> tuple[int, str, str]:
    """``orch ARGV`` in this process (no run starts in these tests): exit code, stdout, stderr."""
    from orchestrator.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --version, --help
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.timeout(120)
def test_missing_stale_and_foreign_runs_are_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = orch(capsys, "status", str(tmp_path / "nowhere"))
    assert code == 2 and err.count("\n") == 1 and "not found" in err

    stale = tmp_path / "stale"
    _record(stale, supervisor={"pid": unused_pid(), "host": os.uname().nodename, "create_time": time.time()})
    (stale / "orch.log").write_text("orch: error: the embedded Ray did not start\n")
    for command in ("status", "stop"):
        code, _, err = orch(capsys, command, str(stale))
        assert code == 2 and err.count("\n") == 1, err
        assert "is stale" in err and "the embedded Ray did not start" in err and "orch resume" in err

    foreign = tmp_path / "foreign"
    _record(foreign, uid=os.getuid() + 1, user="someone-else")
    for command in ("status", "stop", "resume", "logs"):
        code, _, err = orch(capsys, command, str(foreign))
        assert code == 2 and "launched by user 'someone-else', not you" in err, err

    code, out, _ = orch(capsys, "status")  # nothing under runs/ here
    assert code == 0 and "no runs under" in out


@pytest.mark.timeout(120)
def test_cfg_job_version_hydra_keys_and_user_preset_dirs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = orch(capsys, "launch", "--cfg", "job", "conf=cpu_gloo", "trainer.max_steps=7")
    assert code == 0 and "preset: cpu_gloo" in out and "max_steps: 7" in out, err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written

    from orchestrator import __version__

    assert orch(capsys, "--version")[:2] == (0, f"orch {__version__}\n")

    for key in ("hydra.run.dir=/tmp/x", "hydra.job.chdir=true"):
        code, _, err = orch(capsys, "launch", "conf=cpu_gloo", key, "--dry-run")
        assert code == 2 and err.count("\n") == 1, err
        assert f"{key.split('=')[0]}=" in err and "run.dir=PATH" in err

    user = tmp_path / "myconf"
    (user / "optim").mkdir(parents=True)
    (user / "mine.yaml").write_text("defaults:\n  - cpu_gloo\n  - _self_\npreset: mine\ntrainer:\n  max_steps: 9\n")
    (user / "optim" / "fast.yaml").write_text("_target_: torch.optim.SGD\nlr: 0.5\n")
    monkeypatch.setenv("ORCH_CONF_PATH", str(user))
    _, helped, _ = orch(capsys, "launch", "--help")
    assert "bert8gpu, cpu_elastic, cpu_gloo, mine" in helped and "adamw, fast, sgd" in helped
    code, out, err = orch(capsys, "launch", "conf=mine", "optim=fast", "--cfg", "job")
    assert code == 0 and "max_steps: 9" in out and "torch.optim.SGD" in out, err
    code, out, err = orch(capsys, "launch", "conf=cpu_gloo", "optim=fast", "--cfg", "job")
    assert code == 0 and "torch.optim.SGD" in out, err  # orch's presets see the user's groups too


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_multirun_sweep_runs_each_combination_in_its_own_run_dir(tmp_path, capsys, monkeypatch):
    """The sweep is one orch command of its own (one node per run: a sweep's runs are what it is about);
    the status table after it, the CLI's main in this process."""
    out = run_orch("launch", "-m", "conf=cpu_gloo", "trainer.max_steps=5", "optim.lr=1e-3,1e-4", "launcher=local",
                   "cluster.nnodes=1", cwd=tmp_path, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert "sweep: 2/2 succeeded" in out.stdout
    table = out.stdout.split("sweep: 2/2 succeeded", 1)[1]
    assert "optim.lr=0.001" in table and "optim.lr=0.0001" in table
    runs = sorted((tmp_path / "runs" / "cpu_gloo").iterdir())
    assert len(runs) == 2
    lrs = set()
    for run in runs:
        assert json.loads((run / "summary.json").read_text())["status"] == "succeeded"
        lrs.add(json.loads((run / "launch.json").read_text())["overrides"][1])
    assert lrs == {"optim.lr=0.001", "optim.lr=0.0001"}
    monkeypatch.chdir(tmp_path)
    table = orch_here(capsys, "status")  # the runs under runs/, as a table
    assert table.returncode == 0 and table.stdout.count(" succeeded ") == 2, table.stdout
