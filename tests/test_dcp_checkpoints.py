"""The ``dcp`` checkpoint engine (orchestrator/checkpoint/dcp_engine.py) against the real thing: FSDP2
(``fully_shard`` on a CPU mesh) and DDP over gloo in 1-3 spawned processes (tests/dcp_ranks.py), torch DCP's
fsspec writer and reader, orch's manifest-last commit. A single process without a process group runs in
process (DCP's ``no_dist``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dcp_ranks import digest, run_ranks
from orchestrator.checkpoint import CheckpointManager, format_checkpoint_list, step_dirname
from orchestrator.checkpoint.export import export_weights
from orchestrator.checkpoint.inspect import inspect_checkpoint
from orchestrator.config.schema import CheckpointConfig
from orchestrator.elastic.checkpoints import SessionCheckpoints
from orchestrator.errors import CheckpointError
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Progress, TrainingState, params_sha256

LONE = DistContext(0, 1, 0, 1, 0, 0)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist, on purpose


def lone_session(url: str, engine: str = "dcp", seed: int = 0, out: int = 2,
                 **cfg) -> tuple[SessionCheckpoints, TrainingState]:
    """A one-process session (no process group) over a small model, its optimizer and scheduler."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, out))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    state = TrainingState(Progress())
    state.register({"model": model, "optim": optim, "sched": sched})
    cfg.setdefault("async_save", False)
    return SessionCheckpoints(CheckpointConfig(**cfg), url, state, LONE, torch.device("cpu"), 0, lambda e: None,
                              engine=engine), state


def train(state: TrainingState, steps: int) -> None:
    model, optim, sched = (state.components[k] for k in ("model", "optim", "sched"))
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        optim.step()
        sched.step()
        state.progress.step += 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True])
def test_lone_process_round_trip_and_layout(tmp_path, async_save):
    url = str(tmp_path / "ckpt")
    ckpt, state = lone_session(url, async_save=async_save)
    train(state, 3)
    ckpt.save()
    ckpt.wait()
    files = os.listdir(f"{url}/{step_dirname(3)}")
    assert ".metadata" in files and "__0_0.distcp" in files and "manifest.json" in files
    manifest = json.load(open(f"{url}/{step_dirname(3)}/manifest.json"))
    assert manifest["format"] == "dcp" and set(manifest["files"]) == set(files) - {"manifest.json"}
    info = CheckpointManager(url).list()[0]
    assert info.valid and info.step == 3
    expected, lr = params_sha256(state.components["model"]), state.components["sched"].get_last_lr()
    other, fresh = lone_session(url, seed=1)
    assert params_sha256(fresh.components["model"]) != expected
    assert other.restore() == 3
    assert params_sha256(fresh.components["model"]) == expected
    assert fresh.components["sched"].get_last_lr() == lr and fresh.progress.step == 3
    assert fresh.components["optim"].param_groups[0]["lr"] == lr[0]
    listing = format_checkpoint_list(url).splitlines()
    assert listing[1].split()[-2:] == ["engine", "world_size"] and listing[2].split()[-2:] == ["dcp", "1"]
    text, problem = inspect_checkpoint(url)
    assert problem is None and "engine: dcp  world_size: 1  DCP shards: 1 (+ .metadata)" in text
    out = str(tmp_path / "model.safetensors")
    assert export_weights(url, out) == (3, 4)
    from safetensors.torch import load_file

    exported = load_file(out)
    assert {k: v.tolist() for k, v in exported.items()} == {
        k: v.tolist() for k, v in fresh.components["model"].state_dict().items()}


def plain(obj):
    """Tensors as lists, tuples as lists: values compared exactly, containers by content."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return [plain(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_the_dcp_engine_resumes_a_rank0_checkpoint_and_not_the_reverse(tmp_path, fmt):
    """A DDP run's checkpoint (the rank0 engine's whole payloads) resumes under the dcp engine: model, optimizer
    state (keyed by FQN from the saved parameter indices), schedule and progress; a DCP checkpoint under the
    rank0 engine stays refused in one line."""
    dcp_url, rank0_url = str(tmp_path / "dcp"), str(tmp_path / "rank0")
    for url, engine in ((dcp_url, "dcp"), (rank0_url, "rank0")):
        ckpt, state = lone_session(url, engine=engine, format=fmt)
        train(state, 2)
        ckpt.finish()
    with pytest.raises(CheckpointError, match="checkpoint.engine=dcp"):
        lone_session(dcp_url, engine="rank0")[0].restore()
    other, fresh = lone_session(rank0_url, engine="dcp", seed=1)
    assert other.restore() == 2 and fresh.progress.step == 2
    for name in ("model", "optim", "sched"):  # a tuple (AdamW's betas) comes back a list, as from a DCP checkpoint
        assert plain(fresh.components[name].state_dict()) == plain(state.components[name].state_dict()), name
    train(fresh, 1)  # trains on and saves DCP shards
    other.finish()
    assert [(i.step, i.format) for i in CheckpointManager(rank0_url).list()] == [(2, fmt), (3, "dcp")]


@pytest.mark.timeout(120)
def test_a_model_that_does_not_fit_is_refused_by_name(tmp_path):
    url = str(tmp_path / "ckpt")
    ckpt, state = lone_session(url)
    ckpt.finish()
    with pytest.raises(CheckpointError, match=r"does not fit .*1.weight \(2, 8\)->\(3, 8\)"):
        lone_session(url, out=3)[0].restore()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_world_size_resume_is_bit_exact_and_async_saves_commit(tmp_path):
    """2 ranks, FSDP2 with sync saves and DDP with async ones: 6 steps straight (saving at 3 on the way; async
    at 2 and 3 with keep_last=1), then a resume from step 3 to 6: the same model, optimizer and schedule, bit for
    bit. Both async saves committed (the background threads agree on their own gloo group); one is kept."""
    fsdp, ddp = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    first = run_ranks(2, str(tmp_path / "a"),
                      dict(url=fsdp, steps=6, save_at=(3,), strategy="fsdp2", finish=False),
                      dict(url=ddp, steps=6, save_at=(2, 3), async_save=True, keep_last=1, finish=False))
    for url in (fsdp, ddp):
        assert sorted(os.listdir(url)) == [step_dirname(3)]
        files = os.listdir(f"{url}/{step_dirname(3)}")
        assert ".metadata" in files and any(f.endswith(".distcp") for f in files)
    saved = [e for e in first[1]["events"] if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [2, 3] and all(e["async"] for e in saved)
    resumed = run_ranks(2, str(tmp_path / "b"), dict(url=fsdp, steps=6, strategy="fsdp2", finish=False),
                        dict(url=ddp, steps=6, async_save=True, finish=False))
    for before, after in zip(first, resumed):
        assert after["restored"] == 3 and after["loaded"] == before["saved"]["3"]
        assert after["final"] == before["final"] and after["lr"] == before["lr"]
        loaded = next(e for e in after["events"] if e["event"] == "checkpoint_loaded")
        assert loaded["world_size"] == 2 and loaded["saved_world_size"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_reshards_2_to_3_to_1_and_ddp_or_hsdp_to_fsdp2(tmp_path):
    """Saved at world size 2 under FSDP2, DDP and HSDP, loaded under FSDP2 at 3 and at 1: the full model and
    optimizer state are what was saved, bit for bit; ``checkpoint_loaded`` names both world sizes."""
    fsdp, ddp, hsdp = str(tmp_path / "fsdp"), str(tmp_path / "ddp"), str(tmp_path / "hsdp")
    saved = run_ranks(2, str(tmp_path / "a"), dict(url=fsdp, steps=2, save_at=(2,), strategy="fsdp2"),
                      dict(url=ddp, steps=2, save_at=(2,)), dict(url=hsdp, steps=2, save_at=(2,), strategy="hsdp"))
    for world in (3, 1):
        got = run_ranks(world, str(tmp_path / f"w{world}"), *(dict(url=url, steps=2, strategy="fsdp2")
                                                              for url in (fsdp, ddp, hsdp)))
        for before, after in zip(saved, got):
            assert after["restored"] == 2 and after["loaded"] == before["saved"]["2"], world
            loaded = next(e for e in after["events"] if e["event"] == "checkpoint_loaded")
            assert loaded["world_size"] == world and loaded["saved_world_size"] == 2
    from safetensors.torch import load_file

    for url, before in zip((fsdp, ddp, hsdp), saved):  # consolidated in one process, no process group
        export_weights(url, str(tmp_path / "model.safetensors"), step=2)
        assert digest(load_file(str(tmp_path / "model.safetensors"))) == before["saved"]["2"]["model"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_resumes_a_ddp_runs_rank0_checkpoint(tmp_path):
    """A DDP run with the default engine (rank0) saves at step 3; FSDP2 with the dcp engine, on 2 and on 3 ranks,
    resumes it at step 3 with the full model and optimizer state bit for bit (every rank's shards sent from rank
    0's whole payloads), the same schedule, and trains on to step 5, committing DCP shards."""
    url = str(tmp_path / "ckpt")
    saved = run_ranks(2, str(tmp_path / "a"), dict(url=url, steps=3, save_at=(3,), engine="rank0"))[0]
    assert [(i.step, i.format) for i in CheckpointManager(url).list()] == [(3, "torch")]
    for world in (2, 3):
        resumed = run_ranks(world, str(tmp_path / f"w{world}"), dict(
            url=url, steps=5, strategy="fsdp2", save_at=(5,) if world == 3 else (), finish=False, resume="3"))[0]
        assert resumed["restored"] == 3 and resumed["loaded"] == saved["saved"]["3"], world
        loaded = next(e for e in resumed["events"] if e["event"] == "checkpoint_loaded")
        assert (loaded["step"], loaded["world_size"], loaded["saved_world_size"]) == (3, world, 2)
        assert resumed["final"] != resumed["loaded"] and resumed["lr"] == saved["lr"] * 0.5  # StepLR: halved at 4
    assert [(i.step, i.format) for i in CheckpointManager(url).list()] == [(3, "torch"), (5, "dcp")]


@pytest.mark.timeout(120)
def test_engine_config():
    from orchestrator.config.compose import compose_config
    from orchestrator.config.schema import checkpoint_engine
    from orchestrator.errors import ConfigError

    ddp = compose_config("cpu_gloo", ["checkpoint.async=false"])
    assert ddp.checkpoint.async_save is False and checkpoint_engine(ddp.checkpoint, ddp.parallelism) == "rank0"
    sharded = compose_config("cpu_fsdp")
    assert checkpoint_engine(sharded.checkpoint, sharded.parallelism) == "dcp"
    ddp_dcp = compose_config("cpu_gloo", ["checkpoint.engine=dcp"])
    assert checkpoint_engine(ddp_dcp.checkpoint, ddp_dcp.parallelism) == "dcp"
    with pytest.raises(ConfigError, match=r"^checkpoint.engine='rank0' .*parallelism.strategy=fsdp2.* Fix: use "
                                          r"checkpoint.engine=dcp"):
        compose_config("cpu_fsdp", ["checkpoint.engine=rank0"])


@pytest.mark.timeout(120)
def test_dcp_checkpoints_on_s3(s3_bucket):
    """s3:// through s3fs (moto's server): shards and index written in place, the manifest is the commit, a
    resume and an export read them back."""
    url = f"s3://{s3_bucket}/run/ckpt"
    ckpt, state = lone_session(url, async_save=True)
    train(state, 2)
    ckpt.save()
    train(state, 1)
    ckpt.finish()
    manager = CheckpointManager(url)
    assert [(i.step, i.valid, i.format) for i in manager.list()] == [(2, True, "dcp"), (3, True, "dcp")]
    assert {".metadata", "__0_0.distcp", "manifest.json"} <= set(manager.storage.list_files(step_dirname(3)))
    other, fresh = lone_session(url, seed=1)
    assert other.restore() == 3
    assert params_sha256(fresh.components["model"]) == params_sha256(state.components["model"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_shard_write_commits_nothing(tmp_path, monkeypatch, async_save):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    url = str(tmp_path / "ckpt")
    events: list = []
    ckpt, state = lone_session(url, async_save=async_save)
    ckpt.manager._on_event = lambda name, fields: events.append(name)

    def broken(self, plan, planner):
        raise OSError("disk on fire")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    with pytest.raises(CheckpointError, match="disk on fire") as failed:
        ckpt.save()
        ckpt.wait()
    assert "\n" not in str(failed.value) and "rank 0: OSError: disk on fire" in str(failed.value)
    assert "checkpoint_failed" in events and "checkpoint_saved" not in events
    assert not os.path.isdir(url) or not os.listdir(url), "the step's files are removed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("refuse_on_call", [1, 2])
def test_a_fenced_dcp_save_commits_nothing(tmp_path, refuse_on_call):
    """The fence is asked before anything is written and again right before the manifest: a refusal at either
    commits nothing and leaves no files."""
    from orchestrator.checkpoint import CheckpointFenced

    url = str(tmp_path / "ckpt")
    ckpt, state = lone_session(url)
    calls = []

    def fence():
        calls.append(1)
        return "the lease is run other's" if len(calls) == refuse_on_call else None

    ckpt.manager._fence = fence
    with pytest.raises(CheckpointFenced, match="refused, nothing committed"):
        ckpt.save()
    assert CheckpointManager(url).list() == [] and (not os.path.isdir(url) or not os.listdir(url))
