"""The ``logger`` group: trackers write real TensorBoard / MLflow / W&B stores that read back; config errors exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.config.compose import compose_config, load_run_config
from orchestrator.errors import ConfigError, UserError
from orchestrator.tracking import Trackers, flatten_config, numeric_metrics, open_trackers

pytestmark = pytest.mark.timeout(120)

STEPS = [2, 4, 6, 8, 10]
SECRET = "s3cr3t-do-not-log"


def loss_at(step: int) -> float:
    return 10.0 / step


def tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def mlflow_run(tracking_uri: str, experiment: str = "orch"):
    """The one run of ``experiment`` in the store, and the client that read it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} in {tracking_uri}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


@pytest.fixture
def file_store_readable(monkeypatch):
    """MLflow 3 refuses to open a file store without this (the trackers set it for themselves when writing)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def test_tensorboard_and_mlflow_store_config_and_every_logged_step(tmp_path, monkeypatch, file_store_readable):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed: pip install 'orch[tensorboard]'")
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed: pip install 'orch[mlflow]'")
    monkeypatch.setenv("ORCH_TEST_API_TOKEN", SECRET)  # environment variables never reach a tracker
    cfg = compose_config("cpu_gloo", ["logger=[tensorboard,mlflow]", "+k8s.env.HF_TOKEN=" + SECRET,
                                      "run.id=track-1"])
    trackers = open_trackers(cfg, tmp_path, rank=0)
    assert trackers.names == ["tensorboard", "mlflow"]
    trackers.log_config(cfg)
    for step in STEPS:
        trackers.log_metrics(step, {"loss": loss_at(step), "lr": 1e-3, "status": "ok", "bad": float("nan")})
    trackers.close()
    trackers.close()  # idempotent

    assert tensorboard_scalars(tmp_path / "tensorboard", "loss") == pytest.approx({s: loss_at(s) for s in STEPS})
    assert set(tensorboard_scalars(tmp_path / "tensorboard", "lr")) == set(STEPS)

    client, run = mlflow_run((tmp_path / "mlruns").as_uri())
    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx({s: loss_at(s) for s in STEPS})
    assert set(run.data.metrics) == {"loss", "lr"}  # strings and NaN are not metrics
    assert run.info.status == "FINISHED" and run.info.run_name == "track-1"
    params = run.data.params
    assert params["trainer.max_steps"] == "40" and params["preset"] == "cpu_gloo"
    assert params["logger.mlflow.experiment"] == "orch"
    assert not any(SECRET in v for v in params.values()) and "k8s.env.HF_TOKEN" not in params
    event_bytes = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").iterdir())
    assert SECRET.encode() not in event_bytes and b"trainer.max_steps" in event_bytes


def test_settings_move_the_stores(tmp_path, monkeypatch, file_store_readable):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    for name in ("ORCH_RUN_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    tb_dir, store = tmp_path / "tb", tmp_path / "elsewhere" / "mlruns"
    cfg = compose_config("cpu_gloo", ["logger=[mlflow,tensorboard]", f"logger.tensorboard.log_dir={tb_dir}",
                                      f"logger.mlflow.tracking_uri={store.as_uri()}", "logger.mlflow.experiment=exp"])
    with open_trackers(cfg, tmp_path / "run", rank=0) as trackers:
        trackers.log_metrics(1, {"loss": 1.5})
    assert tensorboard_scalars(tb_dir, "loss") == {1: 1.5}
    _, run = mlflow_run(store.as_uri(), "exp")
    assert run.data.metrics == {"loss": 1.5} and run.info.run_name == "run"  # no run.id: the run dir's name
    assert not (tmp_path / "run").exists()


def test_restarted_rank0_continues_the_same_mlflow_run(tmp_path, monkeypatch, file_store_readable):
    """Workers restart after a failure or a membership change: one orch run stays one MLflow run."""
    pytest.importorskip("mlflow")
    monkeypatch.delenv("ORCH_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "cpu_gloo-20261130-abcd")  # torchrun's rendezvous id = orch's run id
    cfg = compose_config("cpu_gloo", ["logger=mlflow"])
    for attempt, steps in enumerate(([1, 2, 3], [3, 4])):
        with open_trackers(cfg, tmp_path, rank=0) as trackers:
            trackers.log_config(cfg)
            for step in steps:
                trackers.log_metrics(step, {"loss": float(step + attempt)})
    client, run = mlflow_run((tmp_path / "mlruns").as_uri())
    assert run.info.run_name == "cpu_gloo-20261130-abcd" and run.info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 4.0), (4, 5.0)]


@pytest.mark.slow
def test_wandb_offline_writes_its_run_under_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'orch[wandb]'")
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)  # the settings decide, not the developer's shell
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_config("cpu_gloo", ["logger=wandb", "logger.wandb.project=orch-test"])
    assert cfg.logger.wandb.mode == "offline"
    with open_trackers(cfg, tmp_path, rank=0) as trackers:
        trackers.log_config(cfg)
        for step in STEPS:
            trackers.log_metrics(step, {"loss": loss_at(step)})
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    [records] = run_dir.glob("run-*.wandb")
    data = records.read_bytes()
    assert b"loss" in data and b"trainer.max_steps" in data


def test_other_ranks_and_logger_none_get_a_no_op(tmp_path):
    cfg = compose_config("cpu_gloo", ["logger=[tensorboard,mlflow]"])
    for trackers in (open_trackers(cfg, tmp_path, rank=1), open_trackers(compose_config("cpu_gloo"), tmp_path, 0),
                     open_trackers(object(), tmp_path, 0)):
        assert not trackers and trackers.names == []
        trackers.log_config(cfg)
        trackers.log_metrics(1, {"loss": 1.0})
        trackers.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failing_tracker_is_dropped_and_the_others_keep_logging():
    class Broken:
        closed = False

        def log_metrics(self, step, metrics):
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    class Recording:
        def __init__(self):
            self.seen = []

        def log_metrics(self, step, metrics):
            self.seen.append((step, metrics))

        def close(self):
            pass

    good = Recording()
    trackers = Trackers({"broken": Broken(), "good": good})
    trackers.log_metrics(1, {"loss": 2.0})
    trackers.log_metrics(2, {"loss": 1.0})
    assert trackers.names == ["good"] and Broken.closed
    assert good.seen == [(1, {"loss": 2.0}), (2, {"loss": 1.0})]


def test_flatten_config_drops_env_blocks_and_masks_secrets():
    flat = flatten_config({"a": {"b": 1, "c": None, "d": {}}, "l": [1, 2], "env": {"X": SECRET},
                           "store": {"api_key": SECRET, "url": f"https://user:{SECRET}@host/x"}})
    assert flat == {"a.b": "1", "a.c": "", "a.d": "{}", "l": "[1, 2]", "store.api_key": "<redacted>",
                    "store.url": "https://user:***@host/x"}


def test_numeric_metrics_keeps_finite_numbers_only():
    import torch

    values = numeric_metrics({"loss": torch.tensor(1.5), "step": 3, "ok": True, "s": "x", "n": None,
                              "inf": float("inf"), "v": torch.ones(2)})
    assert values == {"loss": 1.5, "step": 3.0}


# --- the config group -------------------------------------------------------------------------------------


def test_logger_defaults_to_none_and_a_list_selects_several():
    assert compose_config("cpu_gloo").logger.enabled == []
    assert compose_config("cpu_gloo", ["logger=none"]).logger.enabled == []
    both = compose_config("cpu_gloo", ["logger=[tensorboard,mlflow]"]).logger
    assert both.enabled == ["tensorboard", "mlflow"]
    assert both.tensorboard.log_dir is None and both.mlflow.tracking_uri is None and both.mlflow.experiment == "orch"
    assert both.wandb is None
    wandb = compose_config("cpu_gloo", ["logger=wandb"]).logger.wandb
    if wandb is not None:  # composes only where wandb is installed (validation checks the package)
        assert (wandb.project, wandb.mode, wandb.dir) == ("orch", "offline", None)


def test_logger_settings_survive_the_run_dir_config_yaml(tmp_path):
    """Workers load ``config.yaml`` back onto the schema (as launch.py writes it)."""
    from omegaconf import OmegaConf

    cfg = compose_config("cpu_gloo", ["logger=[tensorboard,mlflow]", "logger.mlflow.experiment=e"])
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert load_run_config(str(path)).logger == cfg.logger


@pytest.mark.parametrize("overrides, key, words", [
    (["logger=nope"], "logger", "use one of mlflow, none, tensorboard, wandb"),
    (["logger=[tensorboard,nope]"], "logger", "use one of mlflow, none, tensorboard, wandb"),
    (["logger.mlflow.experiment=x"], "logger.mlflow.experiment", "logger=mlflow"),
    (["logger=mlflow", "logger.mlflow.bogus=1"], "logger.mlflow.bogus", "not a known key"),
    (["logger=tensorboard", "logger.wandb.mode=online"], "logger.wandb.mode", "logger=wandb"),
])
def test_bad_logger_config_names_key_and_fix(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        compose_config("cpu_gloo", overrides)
    message = str(info.value)
    assert message.startswith(key) and words in message and "Fix:" in message and "\n" not in message


def test_wandb_mode_is_checked(monkeypatch):
    monkeypatch.setattr("orchestrator.tracking.api.package_installed", lambda package: True)
    with pytest.raises(ConfigError, match=r"logger.wandb.mode='cloud' is not a known choice"):
        compose_config("cpu_gloo", ["logger=wandb", "logger.wandb.mode=cloud"])


@pytest.mark.parametrize("args, line", [
    (["logger=nope"], "logger='nope' is not a known option of group 'logger'. "
                      "Fix: use one of mlflow, none, tensorboard, wandb"),
    (["logger=[tensorboard,mlflow]"], "logger=mlflow: the mlflow package is not installed. "
                                      "Fix: pip install 'orch[mlflow]'"),
])
def test_cli_bad_logger_exits_2_with_one_line(tmp_path, capsys, monkeypatch, args, line):
    from orchestrator.cli import main

    monkeypatch.setattr("orchestrator.tracking.api.package_installed", lambda package: package != "mlflow")
    assert main(["launch", "conf=cpu_gloo", *args, f"run.dir={tmp_path / 'run'}"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [f"orch: error: {line}"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["tensorboard", "mlflow", "wandb"])
def test_missing_package_names_the_extra(monkeypatch, name, tmp_path):
    monkeypatch.setattr("orchestrator.tracking.api.package_installed", lambda package: False)
    with pytest.raises(UserError) as info:
        compose_config("cpu_gloo", [f"logger={name}"])
    assert str(info.value) == f"logger={name}: the {name} package is not installed. Fix: pip install 'orch[{name}]'"
    assert info.value.exit_code == 2
    # open_trackers says the same where a worker lacks it (e.g. another Ray node)
    monkeypatch.setattr("orchestrator.tracking.api.package_installed", lambda package: True)
    cfg = compose_config("cpu_gloo", [f"logger={name}"])
    monkeypatch.setattr("orchestrator.tracking.api.package_installed", lambda package: False)
    with pytest.raises(UserError, match=f"pip install 'orch\\[{name}\\]'"):
        open_trackers(cfg, tmp_path, rank=0)


# --- end to end -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launch_logs_to_tensorboard_and_mlflow(tmp_path, file_store_readable):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from orchproc import read_jsonl, run_orch

    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", "launcher=local", "logger=[tensorboard,mlflow]",
                      "trainer.max_steps=10", "trainer.log_every=2", f"run.dir={run_dir}", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logged = {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(logged) == STEPS
    assert tensorboard_scalars(run_dir / "tensorboard", "train/loss") == pytest.approx(logged, rel=1e-6)
    assert tensorboard_scalars(run_dir / "tensorboard", "summary/steps_completed") == {10: 10.0}
    client, run = mlflow_run((run_dir / "mlruns").as_uri())
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(logged)
    assert run.info.status == "FINISHED" and run.data.params["trainer.max_steps"] == "10"
    assert run.data.metrics["summary/succeeded"] == 1.0 and 0 < run.data.metrics["goodput/goodput"] < 1
    assert not [k for k in run.data.params if k.startswith("k8s.")], "a local launch: no Kubernetes keys"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "summary.json"}


def test_records_get_the_ecosystems_names_and_params_only_what_matters(monkeypatch):
    """HF/Lightning naming for every script style's records; no k8s.* keys outside a pod, no empty values."""
    from orchestrator.elastic.metrics import flatten
    from orchestrator.tracking.api import relevant_params

    record = {"t": 1.0, "step": 4, "loss": 2.0, "lr": 1e-3, "samples_per_s": 80.0, "world_size": 2,
              "step_time_s": 0.1, "restart_count": 1, "grad_norm": None, "timing": {"forward_s": 0.02}}
    assert flatten(record) == {"train/loss": 2.0, "train/lr": 1e-3, "train/samples_per_s": 80.0,
                               "system/world_size": 2, "system/step_time_s": 0.1, "system/restart_count": 1,
                               "system/timing/forward_s": 0.02}
    params = flatten_config(compose_config("cpu_gloo", []))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kept = relevant_params(params)
    assert any(k.startswith("k8s.") for k in params) and not any(k.startswith("k8s.") for k in kept)
    assert "" not in kept.values() and kept["trainer.max_steps"] == params["trainer.max_steps"]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # inside a pod the manifest's keys matter
    assert any(k.startswith("k8s.") for k in relevant_params(params))


def test_the_runs_end_adds_final_metrics_and_artifacts_to_the_same_runs(tmp_path, monkeypatch, file_store_readable):
    """What the driver does after summary.json: the tracker runs rank 0 logged into get the summary's figures,
    config.yaml and summary.json (MLflow artifacts; TensorBoard hparams and a text summary)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    import json

    from orchestrator.newrun import write_config
    from orchestrator.tracking.run_end import record_run_end

    cfg = compose_config("cpu_gloo", ["logger=[tensorboard,mlflow]", f"run.dir={tmp_path}"])
    write_config(cfg, str(tmp_path))
    summary = {"status": "succeeded", "steps_completed": 10, "wall_s": 12.5, "final_loss": 1.5,
               "goodput": {"goodput": 0.8, "productive_s": 10.0, "lost_steps": 0, "badput": {"launch_s": 2.5}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with open_trackers(cfg, tmp_path, rank=0, run_name="end-1") as trackers:  # rank 0, during the run
        trackers.log_metrics(10, {"train/loss": 1.5})
    record_run_end(cfg, tmp_path, "end-1", summary)

    client, run = mlflow_run((tmp_path / "mlruns").as_uri())
    assert run.info.run_name == "end-1" and run.info.status == "FINISHED"
    assert run.data.metrics["summary/wall_s"] == 12.5 and run.data.metrics["goodput/goodput"] == 0.8
    assert run.data.metrics["goodput/badput/launch_s"] == 2.5 and run.data.metrics["train/loss"] == 1.5
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "summary.json"}
    assert tensorboard_scalars(tmp_path / "tensorboard", "summary/wall_s") == {10: 12.5}
    event_bytes = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").rglob("events.*"))
    assert b"hparams" in event_bytes and b"succeeded" in event_bytes
