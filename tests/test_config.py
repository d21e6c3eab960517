"""Every preset composes and validates; every bad input exits 2 with one clear line and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.config.compose import compose_config, list_presets
from orchestrator.errors import ConfigError, UserError
from orchproc import orch_here, run_orch

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("preset", ["cpu_gloo", "cpu_elastic", "bert8gpu"])
def test_every_preset_composes_and_validates(preset):
    cfg = compose_config(preset)
    assert cfg.preset == preset
    assert cfg.model["_target_"] and cfg.optim["_target_"] and cfg.scheduler["_target_"]
    assert cfg.data.dataset["_target_"]


def test_presets_are_listed():
    assert {"cpu_gloo", "cpu_elastic", "bert8gpu"} <= set(list_presets())


def test_preset_shapes():
    bert = compose_config("bert8gpu")
    assert (bert.backend.name, bert.cluster.device, bert.cluster.nproc_per_node) == ("nccl", "cuda", 8)
    assert bert.ddp.static_graph and not bert.ddp.find_unused_parameters
    assert bert.amp.enabled and bert.amp.dtype == "bf16"
    assert (bert.model["hidden_size"], bert.model["num_layers"], bert.model["vocab_size"]) == (768, 12, 30522)
    gloo = compose_config("cpu_gloo")
    assert (gloo.backend.name, gloo.cluster.device, gloo.cluster.max_nodes) == ("gloo", "cpu", 2)
    elastic = compose_config("cpu_elastic")
    assert (elastic.cluster.min_nodes, elastic.cluster.max_nodes) == (1, 3)


def test_bert_base_has_about_110m_parameters():
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):  # the same parameters, without allocating and initializing 440 MB of them
        model = instantiate(compose_config("bert8gpu").model)
    assert 105e6 < sum(p.numel() for p in model.parameters()) < 115e6


def test_hydra_overrides_add_and_delete():
    cfg = compose_config("cpu_gloo", ["cluster.nnodes=2:4", "+optim.amsgrad=true", "~scheduler.min_lr_ratio",
                                      "ddp.static_graph=true", "trainer.global_batch_size=96"])
    assert (cfg.cluster.min_nodes, cfg.cluster.max_nodes) == (2, 4)
    assert cfg.optim["amsgrad"] is True
    assert "min_lr_ratio" not in cfg.scheduler
    assert cfg.ddp.static_graph


def test_group_option_swaps_model_and_optimizer():
    cfg = compose_config("cpu_gloo", ["optim=sgd", "scheduler=constant"])
    assert cfg.optim["_target_"] == "torch.optim.SGD"
    assert cfg.scheduler["_target_"].endswith("constant")


@pytest.mark.parametrize("overrides, key, words", [
    (["trainer.max_stepz=3"], "trainer.max_stepz", "not a known key"),
    (["cluster.nnodes=3:1"], "cluster.nnodes", "MIN greater than MAX"),
    (["cluster.nproc_per_node=0"], "cluster.nproc_per_node", "use 1 or more"),
    (["trainer.global_batch_size=10"], "trainer.global_batch_size", "not divisible"),
    (["backend=nccl"], "backend.name", "needs CUDA"),
    (["amp.dtype=fp8"], "amp.dtype", "not a known choice"),
    (["+model.hidden_sizee=3"], "model.hidden_sizee", "not an argument"),
    (["optim._target_=torch.optim.Nope"], "optim._target_", "cannot be imported"),
])
def test_bad_config_names_key_value_and_fix(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        compose_config("cpu_gloo", overrides)
    message = str(info.value)
    assert message.startswith(key) and words in message and "Fix:" in message
    assert "\n" not in message


@pytest.mark.parametrize("overrides, key, words, suggests_plus", [
    (["trainer.max_stepz=3"], "trainer.max_stepz", "is not a known key", False),  # typed: + would be refused too
    (["+trainer.max_stpes=3"], "trainer.max_stpes", "is not a known key", False),
    (["+trainer.max_steps=3"], "trainer.max_steps", "already exists", False),
    (["optim.foo=1"], "optim.foo", "is not a known key", True),  # free-form: +optim.foo=1 adds it
])
def test_plus_key_is_suggested_only_where_it_works(overrides, key, words, suggests_plus):
    with pytest.raises(ConfigError) as info:
        compose_config("cpu_gloo", overrides)
    message = str(info.value)
    assert message.startswith(key) and words in message
    assert (f"+{key}=" in message.split("Fix:", 1)[1]) == suggests_plus


def test_elastic_range_checks_batch_at_every_world_size():
    # 16 divides by 8 x 1 and 8 x 2 but not by 8 x 3: a shrink or grow to 3 nodes would break the math.
    with pytest.raises(ConfigError, match="at 3 node"):
        compose_config("cpu_gloo", ["cluster.nnodes=1:3"])


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(UserError) as info:
        compose_config("nope")
    assert "cpu_gloo" in str(info.value) and "bert8gpu" in str(info.value)


@pytest.mark.parametrize("args, words", [
    (["conf=nope"], "is not a known preset"),
    (["conf=cpu_gloo", "trainer.bogus=1"], "trainer.bogus"),
    (["conf=cpu_gloo", "cluster.nnodes=4:2"], "MIN greater than MAX"),
    (["conf=cpu_gloo", "cluster.nproc_per_node=0"], "cluster.nproc_per_node"),
    (["conf=cpu_gloo", "trainer.micro_batch_size=3"], "trainer.global_batch_size"),
    (["conf=bert8gpu"], "needs 8 CUDA GPU(s)"),
    (["conf=cpu_gloo", "cluster.device=cuda"], "CUDA GPU(s)"),
    (["trainer.max_steps=3"], "give exactly one conf=NAME"),
])
def test_cli_bad_input_exits_2_with_one_line_and_no_run_dir(tmp_path, capsys, args, words):
    """In process (the CLI's own main): each case in milliseconds. The installed console script is covered
    once below."""
    from orchestrator.cli import main

    assert main(["launch", *args, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_console_script_exits_2_with_one_line_and_no_run_dir(tmp_path):
    result = run_orch("launch", "conf=cpu_gloo", "cluster.nnodes=4:2", f"run.dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "MIN greater than MAX" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_cuda_message_suggests_dry_run_and_cpu_preset(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["launch", "conf=bert8gpu", f"run.dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "--dry-run" in err and "conf=cpu_gloo" in err


def test_help_lists_presets_and_groups(capsys):
    for args in (["--help"], ["launch", "--help"]):
        result = orch_here(capsys, *args)
        assert result.returncode == 0
        for word in ("cpu_gloo", "bert8gpu", "cpu_elastic", "backend", "model", "optim", "scheduler", "data"):
            assert word in result.stdout


@pytest.mark.parametrize("args, here", [
    ([], 1),                                                                    # embedded Ray: every node here
    (["launcher=local", "cluster.nnodes=2", "trainer.global_batch_size=512"], 2),
    (["launcher=local", "cluster.nnodes=2", "trainer.global_batch_size=512", "cluster.node_index=1"], 1),  # a pod
    (["cluster.address=10.0.0.1:6379"], 0),                                     # the Ray cluster's nodes bring GPUs
])
def test_gpus_are_checked_for_the_nodes_that_run_on_this_machine(args, here):
    from orchestrator.site import make_site

    cfg = compose_config("bert8gpu", args)
    assert make_site(cfg, "rid").nodes_here == here


def test_a_pod_running_one_node_needs_one_nodes_gpus_and_joining_ray_needs_none_here(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["launch", "conf=bert8gpu", "launcher=local", "cluster.nnodes=2", "trainer.global_batch_size=512",
                 "cluster.node_index=1", f"run.dir={tmp_path / 'pod'}"]) == 2
    err = capsys.readouterr().err
    assert "needs 8 CUDA GPU(s)" in err and "1 node(s) here" in err
    import socket

    with socket.socket() as s:  # a free port nobody answers on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["launch", "conf=bert8gpu", f"cluster.address=127.0.0.1:{port}", f"run.dir={tmp_path / 'ray'}"]) == 2
    err = capsys.readouterr().err
    assert "no Ray cluster answers" in err, err
    assert "CUDA" not in err and not (tmp_path / "ray").exists()


# -- user scripts, simulated GPU nodes, the agents' environment (issue 12) ------------------------------------


def test_batch_checks_apply_only_to_the_builtin_trainer(tmp_path, capsys):
    from orchestrator.cli import main

    # 16 is not divisible by 8 x 8; the built-in trainer refuses it, a user script never reads trainer.*.
    args = ["launch", "conf=cpu_gloo", "cluster.nproc_per_node=4", f"run.dir={tmp_path / 'run'}", "--dry-run"]
    assert main([*args, "entrypoint.script=x.py"]) == 0
    assert "x.py" in capsys.readouterr().out
    assert main(args) == 2
    assert "trainer.global_batch_size" in capsys.readouterr().err


def test_the_dry_run_shows_the_optimizer_and_the_scheduler(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["launch", "conf=cpu_gloo", "optim.lr=0.01", f"run.dir={tmp_path / 'run'}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "  optim:        target=torch.optim.AdamW, lr=0.01, betas=[0.9, 0.999], weight_decay=0.01" in out, out
    assert "  scheduler:    target=orchestrator.runtime.schedule.warmup_cosine, warmup_steps=5, total_steps=40" in out


def test_run_dir_interpolations_in_entrypoint_args_see_the_final_run_dir(tmp_path, monkeypatch):
    from orchestrator.launch import compose_for_launch
    from orchestrator.plan.plan import build_plan

    monkeypatch.chdir(tmp_path)
    for run_dir, expected in (("rel/run", tmp_path / "rel" / "run"), (None, None)):
        cfg = compose_for_launch("cpu_gloo", ["entrypoint.script=x.py", "entrypoint.args=[--out,'${run.dir}/out']",
                                              *([f"run.dir={run_dir}"] if run_dir else [])])
        final = cfg.run.dir
        assert Path(final).is_absolute() and (expected is None or final == str(expected))
        assert expected is not None or final.startswith(str(tmp_path / "runs" / "cpu_gloo"))
        plan = build_plan(cfg, final, "rid")
        assert plan.nodes[0].argv[-3:] == ("x.py", "--out", f"{final}/out")
    assert not (tmp_path / "rel").exists() and not (tmp_path / "runs").exists()  # composing writes nothing


@pytest.mark.parametrize("overrides, devices, expected", [
    ([], None, ["0,1", "2,3"]),                                   # every device, by index
    ([], ["4", "5", "6", "7"], ["4,5", "6,7"]),                   # an existing CUDA_VISIBLE_DEVICES list
    ([], ["GPU-a", "GPU-b", "GPU-c"], ["GPU-a,GPU-b", None]),      # too few: the resource check refuses the launch
    (["cluster.node_index=1"], ["0", "1"], [None, None]),         # a pod: its own GPUs, untouched
    (["launcher=ray"], None, [None, None]),                       # Ray sets CUDA_VISIBLE_DEVICES per actor
])
def test_simulated_cuda_nodes_get_disjoint_gpus(overrides, devices, expected):
    from orchestrator.plan.plan import build_plan

    cfg = compose_config("bert8gpu", ["launcher=local", "cluster.nnodes=2", "cluster.nproc_per_node=2",
                                      "trainer.global_batch_size=512", *overrides])
    plan = build_plan(cfg, "/tmp/run", "rid", devices=devices)
    assert [n.env.get("CUDA_VISIBLE_DEVICES") for n in plan.nodes] == expected


def test_cpu_nodes_and_the_default_device_list_from_the_environment(monkeypatch):
    from orchestrator.plan.plan import build_plan, visible_devices

    assert visible_devices({}) is None and visible_devices({"CUDA_VISIBLE_DEVICES": "3, 1"}) == ["3", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    cpu = compose_config("cpu_gloo", ["launcher=local"])
    assert all("CUDA_VISIBLE_DEVICES" not in n.env for n in build_plan(cpu, "/tmp/run", "rid", devices=["0"]).nodes)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7,8,9")
    cfg = compose_config("bert8gpu", ["launcher=local", "cluster.nnodes=2", "cluster.nproc_per_node=2",
                                      "trainer.global_batch_size=512"])
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in build_plan(cfg, "/tmp/run", "rid").nodes] == ["6,7", "8,9"]


def test_the_driver_env_forwarded_to_agents_by_allow_and_deny_list(tmp_path):
    from orchestrator.controller.agent_env import forwarded_env

    environ = {"AWS_SECRET_ACCESS_KEY": "s", "HF_TOKEN": "t", "WANDB_API_KEY": "k", "MLFLOW_TRACKING_URI": "u",
               "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
               "OMP_NUM_THREADS": "2", "HTTPS_PROXY": "p", "no_proxy": "n", "PYTHONPATH": "rel",
               "CUDA_VISIBLE_DEVICES": "0", "HOME": "/home/me", "PATH": "/bin", "RAY_ADDRESS": "x", "RANK": "3",
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5", "MY_PASSWORD": "pw"}
    assert sorted(forwarded_env(environ)) == sorted(
        ["AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "NCCL_DEBUG",
         "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS", "HTTPS_PROXY", "no_proxy", "PYTHONPATH"])
    # PYTHONPATH entries under the working directory also resolve in a remote node's copy of it.
    cwd = str(tmp_path / "proj")
    value = os.pathsep.join([f"{cwd}/src", "/opt/lib", cwd, "tests"])
    assert forwarded_env({"PYTHONPATH": value}, cwd)["PYTHONPATH"] == os.pathsep.join([value, "src", "."])


def test_forwarded_secrets_reach_the_agents_but_never_the_run_dir(tmp_path, monkeypatch):
    from orchestrator.controller.agents import AgentMaker
    from orchestrator.controller.api import AgentStarted, ClusterNode, ManualClock
    from orchestrator.controller.controller import Controller
    from orchestrator.ft.driver import driver_mode
    from orchestrator.plan.plan import build_plan
    from orchestrator.rundir import EventLog

    class RecordingPool:
        def __init__(self):
            self.started, self.pending = [], []

        def nodes(self):
            return [ClusterNode("n0", "10.0.0.1", 2)]

        def start(self, spec, node_id):
            self.started.append(spec)
            self.pending.append(AgentStarted(spec.agent_id, spec.node, node_id, "10.0.0.1", 100 + spec.agent_id))

        def poll(self, timeout_s):
            out, self.pending = self.pending, []
            return out

        def stop(self, agent_id, grace_s, agent_only=False):
            pass

        def close(self):
            pass

    secret = "orch-test-secret-5f3a"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = compose_config("cpu_gloo", [f"run.dir={tmp_path}"])
    plan = build_plan(cfg, str(tmp_path), "rid", store_port=29400)
    (tmp_path / "plan.json").write_text(plan.to_json())
    events = EventLog(tmp_path, clock=ManualClock().time)
    pool = RecordingPool()
    controller = Controller(cfg, plan, pool, events, AgentMaker(plan, driver_mode(cfg), {}, gated=True),
                            clock=ManualClock())
    for _ in range(3):
        controller._step()
    assert len(pool.started) == 2
    for spec in pool.started:
        assert spec.env["AWS_SECRET_ACCESS_KEY"] == secret and "CUDA_VISIBLE_DEVICES" not in spec.env
        assert spec.env["ORCH_NODE"] == str(spec.node)  # the plan's env on top
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_joining_a_ray_cluster_ships_the_working_directory(tmp_path):
    from orchestrator.lifecycle.rayjobs import shipped_runtime_env

    cwd = str(tmp_path)
    assert shipped_runtime_env(compose_config("cpu_gloo"), cwd) is None  # embedded Ray: this machine
    cfg = compose_config("cpu_gloo", ["cluster.address=10.0.0.1:6379", f"run.dir={tmp_path / 'out' / 'run1'}",
                                      f"checkpoint.url={tmp_path / 'ckpt'}"])
    env = shipped_runtime_env(cfg, cwd)
    assert env["working_dir"] == cwd
    assert {".git", ".venv", "/runs", "/out/run1", "/ckpt"} <= set(env["excludes"])
    cfg = compose_config("cpu_gloo", ["cluster.address=auto", "run.dir=/elsewhere/run", "checkpoint.url=s3://b/p"])
    assert "/elsewhere/run" not in shipped_runtime_env(cfg, cwd)["excludes"]
