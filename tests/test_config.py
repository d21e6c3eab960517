"""Every preset composes and validates; every bad input exits 2 with one clear line and writes nothing."""

from __future__ import annotations

import pytest

from orchestrator.config.compose import compose_config, list_presets
from orchestrator.errors import ConfigError, UserError
from orchproc import run_orch

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
    from hydra.utils import instantiate

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


def test_help_lists_presets_and_groups():
    for args in (["--help"], ["launch", "--help"]):
        result = run_orch(*args, timeout=60)
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
    from orchestrator.plan.plan import build_plan
    from orchestrator.plan.resources import nodes_here

    cfg = compose_config("bert8gpu", args)
    assert nodes_here(build_plan(cfg, "/tmp/run", "rid"), cfg.cluster) == here


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
