"""A run you can walk away from: ``orch launch --detach``, ``orch status``, ``orch logs``, ``orch stop``,
``orch resume`` (docs/lifecycle.md), and the errors for runs that are missing, stale or someone else's."""

from __future__ import annotations

import json
import os
import re
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
def test_detached_launch_survives_its_terminal_then_status_logs_stop_resume(tmp_path, capsys, monkeypatch):
    """The launch and its resume are processes of their own (the detached one outlives its terminal); status,
    logs and stop, which read the run dir and signal the detached process, run the CLI's main in this process.
    After the launch every command names the run by its id, from another directory (the user's index of runs);
    the resume keeps the run id and its one MLflow run."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    launch = [*ORCH, "launch", "conf=cpu_gloo", "trainer.max_steps=400", *SLOW, "logger=[tensorboard,mlflow]", f"run.dir={run_dir}",
              "--detach"]
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
        run_id = status_field(terminal.stdout, "run id")
        assert f"orch status {run_id}" in terminal.stdout, "the hint names the run by its id"
        monkeypatch.chdir(elsewhere)

        def step() -> int:
            status = orch_here(capsys, "status", run_id)
            assert status.returncode == 0, status.stderr
            state = status_field(status.stdout, "state")
            assert state in ("starting", "running"), status.stdout
            return int(s) if state == "running" and (s := status_field(status.stdout, "step")) != "-" else 0

        first = wait_for(step, 150, "a step in orch status", interval=1.0)
        wait_for(lambda: step() > first, 60, "the step count to grow", interval=1.0)

        logs = orch_here(capsys, "logs", run_id)
        assert logs.returncode == 0 and " rank0] step " in logs.stdout, logs.stderr  # [nodeN rank0] step ...
        node_log = orch_here(capsys, "logs", run_id, "--node", "1")
        assert node_log.returncode == 0 and "world size 2" in node_log.stdout, node_log.stderr
        table = orch_here(capsys, "status")  # every run the user launched, wherever its run dir is
        assert table.returncode == 0 and run_id in table.stdout and str(run_dir) in table.stdout, table.stdout

        stopped = orch_here(capsys, "stop", run_id)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        said = re.search(r"stopped at step (\d+) \(emergency checkpoint at step (\d+)\)", stopped.stdout)
        assert said and said.group(1) == said.group(2), stopped.stdout  # one step named
        wait_for(lambda: not _alive(pid), 30, "the detached process to exit")
    finally:
        stop_tree(pid)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps_completed"] < 400
    saved = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "emergency_checkpoint"]
    assert saved, "no emergency checkpoint was written"
    again = orch_here(capsys, "stop", run_id)  # a stopped run is not running
    assert again.returncode == 2 and "is not running: it ended stopped" in again.stderr

    resumed = run_orch("resume", run_id, "trainer.log_every=50", timeout=240, cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr
    assert "run succeeded: 400 steps" in resumed.stdout
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["overrides"] == ["trainer.max_steps=400", SLOW[0], "+" + SLOW[1], "logger=[tensorboard,mlflow]",
                                   "trainer.log_every=50"]  # recorded (on the recorded config) + extra
    assert (record["run_id"], record["attempt"]) == (run_id, 2), "the same run, launched a second time"
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("orch").experiment_id])
    assert [r.info.run_name for r in runs] == [run_id], "one MLflow run for the stopped and the resumed launch"
    mlflow_run = client.get_run(runs[0].info.run_id)
    assert max(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")) == 400
    assert mlflow_run.data.metrics["summary/steps_completed"] == 400 and "goodput/goodput" in mlflow_run.data.metrics
    assert "system/world_size" in mlflow_run.data.metrics and mlflow_run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(mlflow_run.info.run_id)} >= {"config.yaml", "summary.json"}
    params = mlflow_run.data.params
    assert params["trainer.max_steps"] == "400" and not [k for k in params if k.startswith("k8s.")], params
    assert "" not in params.values()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    assert "train/loss" in board.Tags()["scalars"]
    events = read_jsonl(run_dir / "events.jsonl")
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == saved[-1]["step"], (loaded, saved)
    status = orch_here(capsys, "status", run_id)
    assert status_field(status.stdout, "state") == "succeeded" and status_field(status.stdout, "step") == "400"
    logs = orch_here(capsys, "logs", run_id)  # the newest attempt's (a foreground one: its node logs, its part)
    assert logs.returncode == 0 and "step 400/400" in logs.stdout, logs.stdout[-2000:]
    before = (int(said.group(1)) - 1) // 5 * 5  # a step the stopped attempt logged (cpu_gloo logs every 5)
    assert f"step {before}/400" not in logs.stdout, "the stopped attempt's lines are not shown"



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

    code, out, _ = orch(capsys, "status")  # the index holds someone else's run only; nothing under runs/ here
    assert code == 0 and "no runs: none launched by you" in out


@pytest.mark.timeout(60)
def test_the_index_finds_a_run_by_id_anywhere_and_lists_failed_ones_with_their_cause(tmp_path, capsys, monkeypatch):
    """Every launch record registers the run (id -> run dir) in the user's index ($XDG_STATE_HOME/orch, 0700): a run
    dir outside runs/ is found by its id from another directory, and `orch status` lists it with its root cause."""
    from orchestrator import run_index
    from orchestrator.events import RunFinished
    from orchestrator.rundir import EventLog

    failed = tmp_path / "somewhere" / "x"
    _record(failed, supervisor={"pid": unused_pid(), "host": os.uname().nodename, "create_time": time.time()})
    EventLog(str(failed)).write(RunFinished(status="failed", attempts=1, node_exit_codes={"0": 1}))
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "root_cause": {
        "rank": 1, "node": 0, "error": "Traceback ...\nRuntimeError: CUDA out of memory"}}))
    assert run_index.lookup("cpu_gloo-x") == failed.resolve()
    index = Path(os.environ["XDG_STATE_HOME"]) / "orch"
    assert (index.stat().st_mode & 0o777, (index / "runs").stat().st_mode & 0o777) == (0o700, 0o700)
    monkeypatch.chdir(tmp_path)
    status = orch_here(capsys, "status", "cpu_gloo-x")
    assert status.returncode == 0 and status_field(status.stdout, "state") == "failed", status.stderr
    assert status_field(status.stdout, "root cause") == "rank 1: RuntimeError: CUDA out of memory"
    table = orch_here(capsys, "status").stdout.splitlines()
    row = next(i for i, line in enumerate(table) if line.startswith("cpu_gloo-x "))
    assert " failed " in table[row] and str(failed.resolve()) in table[row]
    assert table[row + 1].strip() == "root cause: rank 1: RuntimeError: CUDA out of memory"
    code, _, err = orch(capsys, "status", "no-such-run")
    assert code == 2 and "not found" in err and str(index) in err


@pytest.mark.timeout(60)
def test_resume_composes_the_recorded_config_without_the_preset_directory(tmp_path, capsys, monkeypatch):
    """A run of a user preset (ORCH_CONF_PATH), resumed where that directory is not on the path any more: the
    resume composes the run's own config.yaml, its recorded overrides and new ones still apply."""
    from omegaconf import OmegaConf

    from orchestrator.config.compose import CONF_PATH_ENV, compose_config
    from orchestrator.launch_record import new_record, write_record
    from orchestrator.lifecycle.control import resume_args
    from orchestrator.newrun import write_config

    user, run_dir = tmp_path / "myconf", tmp_path / "run"
    (user / "optim").mkdir(parents=True)
    (user / "mine.yaml").write_text("defaults:\n  - cpu_gloo\n  - _self_\npreset: mine\ntrainer:\n  max_steps: 9\n")
    (user / "optim" / "fast.yaml").write_text("_target_: torch.optim.SGD\nlr: 0.5\n")
    monkeypatch.setenv(CONF_PATH_ENV, str(user))
    given = ["optim=fast", "logger=tensorboard", *SLOW, "trainer.log_every=3"]
    ran = compose_config("mine", given)
    write_config(ran, str(run_dir))
    write_record(run_dir, new_record(str(run_dir), "mine-1", "mine", given, "foreground"))
    monkeypatch.delenv(CONF_PATH_ENV)  # another shell: the preset directory is not on the path

    preset, overrides, conf = resume_args("mine-1", ["trainer.max_steps=11"])
    assert overrides == ["logger=tensorboard", SLOW[0], "+" + SLOW[1], "trainer.log_every=3", "trainer.max_steps=11",
                         f"run.dir={run_dir.resolve()}", "run.id=mine-1"], "optim=fast is in config.yaml already"
    monkeypatch.setenv(CONF_PATH_ENV, str(conf))
    again = compose_config(preset, overrides)
    assert (again.preset, again.trainer.max_steps, again.run.id) == ("mine", 11, "mine-1")
    expected = OmegaConf.to_container(OmegaConf.structured(ran))
    expected["trainer"]["max_steps"], expected["run"] = 11, OmegaConf.to_container(OmegaConf.structured(again))["run"]
    assert OmegaConf.to_container(OmegaConf.structured(again)) == expected, "what ran, plus the new override"
    monkeypatch.delenv(CONF_PATH_ENV)
    code, _, err = orch(capsys, "resume", "mine-1", "optim=sgd")
    assert code == 2 and "optim=sgd" in err and "optim.KEY=VALUE" in err


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
    assert "bert8gpu, bert8gpu_fsdp, cpu_elastic, cpu_fsdp, cpu_gloo, mine" in helped and "adamw, fast, sgd" in helped
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
