"""The Python API: ``orchestrator.compose`` and ``orchestrator.launch`` (docs/python-api.md)."""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import orchestrator
from orchestrator.errors import ConfigError, Interrupted, Preempted, RunFailed, UserError

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_import_is_light_and_launch_stays_a_function():
    code = ("import sys, orchestrator; heavy = [m for m in ('torch', 'hydra', 'ray', 'omegaconf') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout == "[]\n", out.stderr
    importlib.import_module("orchestrator.launch")  # the implementation module: must not shadow the function
    assert callable(orchestrator.launch) and orchestrator.launch.__module__ == "orchestrator"
    from orchestrator.launch import launch_config  # and the module stays importable

    assert callable(launch_config)


def test_compose_returns_the_validated_config():
    cfg = orchestrator.compose("cpu_gloo", ["trainer.max_steps=7", "cluster.nnodes=1:2"])
    assert type(cfg).__name__ == "OrchConfig"
    assert cfg.trainer.max_steps == 7 and (cfg.cluster.min_nodes, cfg.cluster.max_nodes) == (1, 2)
    assert cfg.run.dir is None  # a launch picks the run dir


@pytest.mark.parametrize("call", [
    lambda: orchestrator.compose("no_such_preset"),
    lambda: orchestrator.compose("cpu_gloo", ["trainer.no_such_key=1"]),
    lambda: orchestrator.launch("cpu_gloo", ["trainer.max_steps=oops"]),
])
def test_bad_input_raises_the_cli_exit_2_errors(call):
    with pytest.raises(UserError) as info:
        call()
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2


def _caller_conf(tmp_path: Path) -> str:
    conf = tmp_path / "caller_conf"
    conf.mkdir()
    (conf / "app.yaml").write_text("lr: 0.5\nname: mine\n")
    return str(conf)


def test_a_callers_own_hydra_is_left_as_it_was(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.version import VersionBase

    with initialize_config_dir(config_dir=_caller_conf(tmp_path), version_base=None):  # 1.1 semantics: not orch's
        theirs, base = GlobalHydra.instance(), VersionBase.instance().getbase()
        assert compose(config_name="app").lr == 0.5
        cfg = orchestrator.compose("cpu_gloo", ["trainer.max_steps=3"])
        with pytest.raises(ConfigError):
            orchestrator.compose("cpu_gloo", ["trainer.bogus=1"])  # and after an error, too
        assert cfg.trainer.max_steps == 3
        assert GlobalHydra.instance() is theirs and theirs.is_initialized()
        assert VersionBase.instance().getbase() == base
        assert compose(config_name="app", overrides=["lr=0.1"]).lr == 0.1  # their search path, not orch's conf/
    assert not GlobalHydra.instance().is_initialized()
    orchestrator.compose("cpu_gloo")  # with no Hydra of the caller's: none is left behind
    assert not GlobalHydra.instance().is_initialized()


@pytest.mark.slow
def test_a_hydra_main_app_can_launch(tmp_path):
    """A real ``@hydra.main`` app composes and dry-runs orch inside its task, then uses its own Hydra."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(f"""
        import hydra
        from hydra import compose
        from hydra.core.hydra_config import HydraConfig
        import orchestrator

        @hydra.main(config_path={_caller_conf(tmp_path)!r}, config_name="app", version_base=None)
        def main(cfg):
            result = orchestrator.launch("cpu_gloo", ["run.dir={tmp_path / 'run'}"], dry_run=True)
            again = compose(config_name="app", overrides=["lr=0.25"])
            print(result.status, HydraConfig.get().job.name, cfg.lr, again.lr)

        main()
    """))
    out = subprocess.run([sys.executable, str(app), "hydra.run.dir=.", "hydra.output_subdir=null"],
                         capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "dry-run app 0.5 0.25"
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_nothing_unless_asked(tmp_path, capsys):
    result = orchestrator.launch("cpu_gloo", [f"run.dir={tmp_path / 'run'}"], dry_run=True)
    assert capsys.readouterr().out == ""
    assert (result.status, result.run_dir, result.summary) == ("dry-run", str(tmp_path / "run"), {})
    assert result.run_id.startswith("cpu-gloo-") and len(result.plan.nodes) == 2
    echo = io.StringIO()
    orchestrator.launch("cpu_gloo", [f"run.dir={tmp_path / 'run'}"], dry_run=True, echo=echo)
    assert echo.getvalue().startswith("launch plan for preset 'cpu_gloo'") and capsys.readouterr().out == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("status, error, code", [
    ("succeeded", None, 0), ("failed", RunFailed, 1), ("preempted", Preempted, 75), ("interrupted", Interrupted, 130),
])
def test_a_run_that_did_not_succeed_raises_with_its_result(tmp_path, monkeypatch, capsys, status, error, code):
    """The whole launch (site, store, plan, checks, run dir, controller) but the controller's loop, which
    ends at once with ``status``."""
    runner = importlib.import_module("launchers.runner")
    monkeypatch.setattr(runner, "run_with_signals", lambda controller, *_: status)
    run_dir = tmp_path / "run"
    if error is None:
        result = orchestrator.launch("cpu_gloo", ["launcher=local", f"run.dir={run_dir}"])
    else:
        with pytest.raises(error) as info:
            orchestrator.launch("cpu_gloo", ["launcher=local", f"run.dir={run_dir}"])
        assert info.value.exit_code == code and str(run_dir) in str(info.value)
        result = info.value.result
    assert (result.status, result.run_dir) == (status, str(run_dir))
    assert result.summary["status"] and (run_dir / "summary.json").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "plan.json").exists()
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_one_liner_prints_only_the_status(tmp_path):
    """The documented one-liner, verbatim but for the run dir: stdout is exactly the status line."""
    run_dir = tmp_path / "x"
    code = ("import orchestrator; r = orchestrator.launch('cpu_gloo', ['trainer.max_steps=5', "
            f"'run.dir={run_dir}']); print(r.status)")
    secret = "orch-test-secret-d41d8cd9"
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": secret, "HF_TOKEN": secret}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "succeeded\n", out.stdout
    # Forwarded secrets reach the agents' environment only: nothing in the run dir holds them.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_user_project_on_a_joined_ray_cluster(tmp_path):
    """From a project directory, launch its script (which imports a sibling module) on a joined Ray cluster:
    the directory is shipped (the workers' PYTHONPATH starts at Ray's copy), ``${run.dir}`` in its args is the
    run dir, and the driver's forwarded variables reach it (its PYTHONPATH is unset here, so Ray's stays)."""
    from ray.cluster_utils import Cluster

    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("VALUE = 42\n")
    (project / "train.py").write_text(textwrap.dedent("""
        import json, os, sys
        import helper
        os.makedirs(sys.argv[1], exist_ok=True)
        with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({"value": helper.VALUE, "pythonpath": os.environ.get("PYTHONPATH", ""),
                       "token": os.environ.get("HF_TOKEN")}, f)
    """))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        run_dir = tmp_path / "run"
        code = ("import orchestrator; r = orchestrator.launch('cpu_gloo', ["
                f"'cluster.address={cluster.address}', 'entrypoint.script=train.py', "
                f"\"entrypoint.args=['${{run.dir}}/out']\", 'run.dir={run_dir}']); print(r.status)")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=project,
                             env={**env, "HF_TOKEN": "hf-test-token"})
    finally:
        cluster.shutdown()
    assert out.returncode == 0 and out.stdout == "succeeded\n", out.stdout + out.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((run_dir / "out" / f"rank{rank}.json").read_text())
        assert seen["value"] == 42 and seen["token"] == "hf-test-token"
        assert "working_dir_files" in seen["pythonpath"].split(os.pathsep)[0], seen
