"""Parallelism strategies (orchestrator/parallel/, issue 25): ddp, fsdp2 and hsdp from config. FSDP2 trains the
same model to the same losses as DDP on the same data (real gloo ranks), holds a shard per rank, starts every
rank from rank 0's model; combinations that cannot work exit 2 with one line; the plan shows the strategy;
conf=cpu_fsdp trains under orch launch on two nodes."""

from __future__ import annotations

import pytest
import torch

from orchestrator.config.compose import compose_config
from orchestrator.errors import ConfigError
from orchestrator.parallel import STRATEGIES, strategy_for
from orchestrator.parallel.fsdp2 import hsdp_shape, shard_units
from orchestrator.runtime.models import BertMLM
from orchproc import orch_here, read_jsonl, run_orch, summary
from parallel_ranks import run_ranks


def test_presets_pick_their_strategy_and_every_preset_has_one():
    assert compose_config("cpu_gloo").parallelism.strategy == "ddp"  # the orch_schema default
    fsdp = compose_config("cpu_fsdp")
    assert fsdp.parallelism.strategy == "fsdp2" and fsdp.parallelism.sharded
    assert fsdp.cluster.nnodes == "1:3" and fsdp.launcher == "local" and fsdp.checkpoint.every_n_steps == 10
    with torch.device("meta"):  # shapes only
        model = BertMLM(**{k: v for k, v in fsdp.model.items() if k != "_target_"})
    assert 20e6 < sum(p.numel() for p in model.parameters()) < 40e6  # a few tens of millions
    gpu = compose_config("bert8gpu_fsdp")
    assert (gpu.parallelism.strategy, gpu.amp.enabled, gpu.amp.dtype, gpu.backend.name) == \
        ("fsdp2", True, "bf16", "nccl")
    assert compose_config("cpu_gloo", ["parallelism=hsdp"]).parallelism.strategy == "hsdp"
    assert {type(strategy_for(compose_config("cpu_gloo", [f"parallelism={s}"]))).__name__ for s in STRATEGIES} == \
        {"DDPStrategy", "FSDP2Strategy", "HSDPStrategy"}


@pytest.mark.parametrize("args,key", [
    (["parallelism=fsdp2", "ddp.static_graph=true"], "ddp.static_graph"),
    (["parallelism=hsdp", "ddp.find_unused_parameters=true"], "ddp.find_unused_parameters"),
    (["parallelism.strategy=zero3"], "parallelism.strategy"),
    (["parallelism=fsdp2", "parallelism.shard_modules=[not-a-class]"], "parallelism.shard_modules"),
])
def test_combinations_that_cannot_work_exit_2_with_one_line(tmp_path, capsys, args, key):
    result = orch_here(capsys, "launch", "conf=cpu_gloo", "launcher=local", f"run.dir={tmp_path}/run", *args)
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.count("\n") == 1 and err.startswith(f"orch: error: {key}=") and "Fix:" in err
    assert not (tmp_path / "run").exists()


def test_the_plan_shows_the_strategy_and_its_mesh(tmp_path, capsys):
    gpu = orch_here(capsys, "launch", "conf=bert8gpu_fsdp", "launcher=local", f"run.dir={tmp_path}/a", "--dry-run")
    assert gpu.returncode == 0, gpu.stderr
    assert "parallelism:  strategy=fsdp2, mesh=(shard 8)" in gpu.stdout and "ddp:" not in gpu.stdout
    hsdp = orch_here(capsys, "launch", "conf=cpu_fsdp", "parallelism=hsdp", "cluster.nproc_per_node=2",
                     "trainer.global_batch_size=12", f"run.dir={tmp_path}/b", "--dry-run")
    assert "strategy=hsdp, mesh=(replicate 1..3, shard 2)" in hsdp.stdout, hsdp.stdout
    ddp = orch_here(capsys, "launch", "conf=cpu_gloo", f"run.dir={tmp_path}/c", "--dry-run")
    assert "parallelism:  strategy=ddp" in ddp.stdout and "ddp:          static_graph=False" in ddp.stdout


def test_shard_units_are_the_blocks_or_the_named_classes():
    model = BertMLM(64, 16, 3, 2, 32, 8)
    assert [name for name, _ in shard_units(model, [])] == ["encoder.layers.2", "encoder.layers.1", "encoder.layers.0"]
    assert [name for name, _ in shard_units(model, ["LayerNorm"])][-1] == "embedding_norm"
    with pytest.raises(ConfigError, match=r"parallelism.shard_modules=\['Block'\] names no module of BertMLM"):
        shard_units(model, ["Block", "LayerNorm"])
    assert hsdp_shape(6, 2) == (3, 2) and hsdp_shape(2, 2) == (1, 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp2_and_hsdp_train_like_ddp_on_two_gloo_ranks(tmp_path):
    """fsdp2 through session.wrap (a user's script), the others through the strategy (the built-in trainer)."""
    cases = [{"overrides": ["parallelism=ddp"]}, {"overrides": ["parallelism=fsdp2"], "session": True},
             {"overrides": ["parallelism=hsdp"]},  # one node of two processes: (replicate 1, shard 2)
             {"overrides": ["parallelism=hsdp"], "local_world": 1},  # two nodes of one: (replicate 2, shard 1)
             {"overrides": ["parallelism=fsdp2", "parallelism.activation_checkpointing=true",
                            "parallelism.reshard_after_forward=false"]},
             {"overrides": ["parallelism=fsdp2", "amp.enabled=true", "amp.dtype=fp16"]},
             {"overrides": ["parallelism=fsdp2", "amp.enabled=true", "amp.dtype=bf16"]},  # bf16 params, fp32 reduce
             {"overrides": ["parallelism=ddp", "amp.enabled=true", "amp.dtype=bf16"]},
             {"overrides": ["parallelism=fsdp2", "trainer.compile=true"]},  # each block compiled, then sharded
             {"overrides": ["parallelism=fsdp2", "parallelism.shard_modules=[Block]"], "expect_error": True},
             {"overrides": ["parallelism=fsdp2"], "build": True}]  # built by the strategy, as the trainer does
    ddp, fsdp2, hsdp, replicated, checkpointed, fp16, bf16, ddp_bf16, compiled, bad, built = \
        run_ranks(2, str(tmp_path), cases)
    assert ddp["losses"][-1] < ddp["losses"][0] and len(fsdp2["sha"]) == 64  # it learns; a sharded model hashes
    assert checkpointed["sha"] == fsdp2["sha"]  # activation checkpointing recomputes the same numbers, same names
    for sharded in (fsdp2, hsdp, replicated, checkpointed, compiled, built):
        assert sharded["losses"] == pytest.approx(ddp["losses"], rel=1e-4)
        assert sharded["norms"] == pytest.approx(ddp["norms"], rel=1e-4)
    # Each rank holds half the parameters (a dim-0 shard of each; an odd row count rounds up on rank 0).
    assert ddp["local_numel"] == ddp["numel"] and fsdp2["local_numel"] <= 0.51 * fsdp2["numel"]
    assert fsdp2["mesh"] == [2] and hsdp["mesh"] == [1, 2] and hsdp["mesh_dims"] == ["replicate", "shard"]
    assert replicated["mesh"] == [2, 1] and replicated["local_numel"] == replicated["numel"]
    assert fp16["scaler"] == "ShardedGradScaler" and fp16["losses"] == pytest.approx(ddp["losses"], rel=1e-2)
    assert bf16["scaler"] == "GradScaler" and bf16["losses"] == pytest.approx(ddp_bf16["losses"], rel=1e-2)
    # Built by the strategy: the weights are rank 0's (the same as wrapping a built model), but only rank 0 ever
    # held the whole model; rank 1 built it on the meta device and holds its shard alone, buffers included.
    assert built["sha"] == fsdp2["sha"]
    rank0, rank1 = built["built"]
    assert (rank0["device"], rank1["device"]) == ("cpu", "meta")
    assert rank1["local_bytes"] <= 0.51 * rank1["full_bytes"] and rank0["local_bytes"] <= 0.51 * rank0["full_bytes"]
    assert rank0["buffers"] == rank1["buffers"] == {"kept": [0.0, 1.0, 2.0], "scratch": [2.0, 2.0, 2.0]}
    assert bad["error"].startswith("ConfigError: parallelism.shard_modules=['Block'] names no module of BertMLM")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_fsdp_launch_trains_on_two_nodes(tmp_path):
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_fsdp", "cluster.nnodes=2", "trainer.max_steps=4",
                      "checkpoint.every_n_steps=0", "hang.enabled=false", f"run.dir={run_dir}", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 4
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and {m["world_size"] for m in metrics} == {2}


def test_session_wrap_leaves_a_lone_process_model_alone():
    from orchestrator.elastic import Session

    session = Session(compose_config("cpu_fsdp"))
    model = torch.nn.Linear(2, 2)
    assert session.wrap(model) is model and type(session.strategy).__name__ == "FSDP2Strategy"
    assert type(Session().strategy).__name__ == "DDPStrategy"  # no run config: ddp
