"""The elastic API for user code (orchestrator.elastic): in-process at world size 1 (no process group, or a
private gloo one), and one real launch of examples/elastic_train.py preempted mid-run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import orchestrator.elastic as elastic
from orchestrator.checkpoint import CheckpointManager
from orchestrator.preemption.notices import Notice
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, read_jsonl
from orchestrator.runtime.distributed import DistContext
from orchproc import launch_and_preempt, run_orch, summary

SOLO = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, restart_count=0)
TRAINER_KEYS = {"t", "step", "loss", "lr", "world_size", "samples_per_s", "step_time_s", "last_step_time_s",
                "restart_count"}


@pytest.fixture(autouse=True)
def _plain_process(outside_torchrun):
    """Every test here runs as a plain process (tests/conftest.py: outside_torchrun)."""


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(session: elastic.Session, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """A few steps of a real loop: 8 samples per step through the session's sampler."""
    sampler = session.global_batch_sampler(64, global_batch=8, micro_batch=8)
    for step, batch in zip(session.steps(), sampler):
        x = torch.arange(len(batch) * 4, dtype=torch.float32).reshape(-1, 4) / 100
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        session.step_done(loss=loss, metrics={"grad_steps": 1.0})


def session_at(run_dir: Path, **options) -> elastic.Session:
    options = {"max_steps": 6, "every_n_steps": 3, "log_every": 2, **options}
    return elastic.Session(None, SOLO, str(run_dir), **options)


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / EVENTS_FILE)


@pytest.mark.timeout(60)
def test_restore_returns_the_saved_step_and_state(tmp_path):
    model, optim = build()
    with session_at(tmp_path) as session:
        session.register(model=model, optim=optim)
        assert session.restore() == 0
        train(session, model, optim)
    assert session.step == 6 and session.samples_consumed == 48
    saved = [(e["step"]) for e in events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved == [3, 6], "periodic saves every 3 steps; the last step was saved, so no extra final one"

    fresh, fresh_optim = build(seed=1)
    with session_at(tmp_path, max_steps=8) as again:
        again.register({"model": fresh, "optim": fresh_optim})  # torchtitan's states={...} form
        assert again.restore() == 6
        assert again.global_batch_sampler(64, 8, 8).start_sample == 48, "the data position resumes too"
        for name, p in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], p), name
    loaded = [e for e in events(tmp_path) if e["event"] == "checkpoint_loaded"]
    assert [(e["step"], e["saved_world_size"]) for e in loaded] == [(6, 1)]


@pytest.mark.timeout(60)
def test_the_checkpoint_has_the_built_in_trainers_layout(tmp_path):
    model, optim = build()
    with session_at(tmp_path, max_steps=3) as session:
        session.register(model=model, optim=optim)
        train(session, model, optim)
    loaded = CheckpointManager(str(tmp_path / "checkpoints")).load()
    assert sorted(loaded.state) == ["model", "optim", "rng", "trainer"]
    assert loaded.state["trainer"] == {"step": 3, "samples_consumed": 24, "epoch": 0, "world_size": 1}
    assert len(loaded.state["rng"]["per_rank"]) == 1
    assert {k: loaded.metadata[k] for k in ("world_size", "reason", "step")} == {"world_size": 1, "reason": "periodic",
                                                                                 "step": 3}


@pytest.mark.timeout(60)
def test_a_notice_saves_at_the_boundary_and_raises_the_preempted_exit(tmp_path):
    model, optim = build()
    session = session_at(tmp_path, max_steps=100, every_n_steps=0)
    session.register(model=model, optim=optim)
    session.restore()
    steps = session.steps()
    next(steps)
    session.step_done(loss=1.0)
    next(steps)
    session.preemption.watcher.notice = Notice("chaos", "test notice")
    with pytest.raises(elastic.PreemptedExit) as exit_:
        session.step_done(loss=1.0)
    assert exit_.value.code == elastic.PREEMPTED_EXIT_CODE == 75 and exit_.value.step == 2
    seen = events(tmp_path)
    notice = next(e for e in seen if e["event"] == "preemption_notice")
    assert (notice["source"], notice["step"]) == ("chaos", 2)
    assert [e["step"] for e in seen if e["event"] == "emergency_checkpoint"] == [2]
    saved = CheckpointManager(str(tmp_path / "checkpoints")).load()
    assert saved.step == 2 and saved.metadata["reason"] == "preemption", "committed before the exit"


@pytest.mark.timeout(60)
def test_metrics_records_and_events_are_the_trainers(tmp_path):
    model, optim = build()
    with session_at(tmp_path) as session:
        session.register(model=model, optim=optim)
        train(session, model, optim)
    metrics = read_jsonl(tmp_path / METRICS_FILE)
    assert [m["step"] for m in metrics] == [2, 4, 6], "every log_every=2 steps"
    assert all(TRAINER_KEYS <= set(m) for m in metrics), metrics
    assert all(m["world_size"] == 1 and m["samples_per_s"] > 0 and m["lr"] == 0.1 for m in metrics)
    assert all(m["grad_steps"] == 1.0 for m in metrics), "extra metrics ride along, averaged over ranks"
    names = [e["event"] for e in events(tmp_path)]
    assert names.index("worker_started") < names.index("first_step") < names.index("training_finished")
    finished = next(e for e in events(tmp_path) if e["event"] == "training_finished")
    assert finished["steps_completed"] == 6 and finished["final_loss"] == metrics[-1]["loss"]
    assert len(finished["params_sha256"]) == 64 and finished["progress"]["samples_consumed"] == 48


@pytest.mark.timeout(60)
def test_bare_mode_writes_nothing_and_needs_no_process_group(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optim = build()
    with elastic.init(max_steps=3) as session:
        assert (session.world_size, session.rank, session.distributed) == (1, 0, False)
        assert session.run_dir is None and session.checkpoints is None
        session.register(model=model, optim=optim)
        train(session, model, optim)
    assert session.step == 3
    assert not torch.distributed.is_initialized()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_init_reads_the_run_config_joins_gloo_and_reports_failures(tmp_path, monkeypatch):
    """Under a run dir: max_steps and every_n_steps from its config.yaml, a private gloo group (as DDP needs),
    rendezvous_complete; an exception in the block is recorded as worker_failed naming the rank."""
    from orchestrator.config.compose import compose_config
    from orchestrator.launch import write_config

    cfg = compose_config("cpu_gloo", ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "preemption.sources=[]",
                                      f"run.dir={tmp_path}"])
    write_config(cfg, str(tmp_path))
    monkeypatch.setenv("ORCH_RUN_DIR", str(tmp_path))
    model, optim = build()
    with pytest.raises(ValueError, match="deliberate"):
        with elastic.init(process_group=True) as session:
            assert (session.max_steps, session.every_n_steps) == (4, 2)
            assert session.distributed and torch.distributed.get_backend() == "gloo"
            session.register(model=model, optim=optim)
            train(session, model, optim)
            raise ValueError("deliberate bug after training")
    assert not torch.distributed.is_initialized(), "the session destroyed the group it created"
    seen = events(tmp_path)
    assert next(e for e in seen if e["event"] == "rendezvous_complete")["world_size"] == 1
    failed = next(e for e in seen if e["event"] == "worker_failed")
    assert failed["rank"] == 0 and failed["error"] == "ValueError: deliberate bug after training"
    assert "deliberate bug" in failed["traceback"]
    assert not [e for e in seen if e["event"] == "training_finished"], "a failed block does not finish"


@pytest.mark.timeout(60)
def test_rank0_feeds_every_record_to_the_trackers_and_closes_them(tmp_path, monkeypatch):
    import orchestrator.tracking
    from orchestrator.config.compose import compose_config

    calls: list[tuple] = []

    class Recording:
        def log_config(self, cfg):
            calls.append(("config", cfg.trainer.max_steps))

        def log_metrics(self, step, metrics):
            calls.append(("metrics", step, metrics["train/loss"] == metrics["train/loss"], "step" in metrics))

        def close(self):
            calls.append(("close",))

    monkeypatch.setattr(orchestrator.tracking, "open_trackers", lambda cfg, run_dir, rank: Recording())
    cfg = compose_config("cpu_gloo", ["trainer.max_steps=4", "trainer.log_every=2", "preemption.sources=[]",
                                      f"run.dir={tmp_path}"])
    model, optim = build()
    with elastic.Session(cfg, SOLO, str(tmp_path)) as session:
        session.register(model=model, optim=optim)
        train(session, model, optim)
    assert calls == [("config", 4), ("metrics", 2, True, False), ("metrics", 4, True, False), ("close",)]


@pytest.mark.timeout(30)
def test_misuse_is_refused_with_the_fix(tmp_path):
    model, optim = build()
    session = session_at(tmp_path, checkpoint_url=None)
    with pytest.raises(ValueError, match="session's own"):
        session.register(trainer=model)
    with pytest.raises(ValueError, match="no state_dict"):
        session.register(data=[1, 2, 3])
    with pytest.raises(RuntimeError, match="Fix: call session.restore"):
        session.step_done(loss=1.0)
    session.register(model=model)
    session.restore()
    with pytest.raises(RuntimeError, match="Fix: register every state before"):
        session.register(optim=optim)
    session.finish()


# -- the example under orch -------------------------------------------------------------------------------------

EXAMPLE_STEPS = 1200


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_survives_a_preemption_with_zero_lost_steps(tmp_path):
    """examples/elastic_train.py on two simulated nodes: `orch chaos preempt` of node 1 mid-run gives an
    emergency checkpoint, a resume from it, and every step trained exactly once."""
    run_dir = launch_and_preempt(tmp_path, "examples/elastic_train.py", EXAMPLE_STEPS, 100, preempt_at_step=30)
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == EXAMPLE_STEPS
    assert s["goodput"] and s["goodput"]["lost_steps"] == 0, s["goodput"]
    steps = [m["step"] for m in read_jsonl(run_dir / METRICS_FILE)]
    assert sorted(steps) == list(range(1, EXAMPLE_STEPS + 1)), "every step trained exactly once"
    seen = read_jsonl(run_dir / EVENTS_FILE)
    emergency = [e["step"] for e in seen if e["event"] == "emergency_checkpoint"]
    assert len(emergency) == 1 and emergency[0] < EXAMPLE_STEPS, "the notice came mid-run"
    assert [e["step"] for e in seen if e["event"] == "checkpoint_loaded"] == emergency, "resumed from it"
    assert [e["node"] for e in seen if e["event"] == "node_preempted"] == [1]
    report = run_orch("report", str(run_dir), timeout=60)
    assert report.returncode == 0, report.stderr


@pytest.mark.timeout(60)
def test_a_loop_that_reports_no_samples_shows_no_throughput_rather_than_zero(tmp_path, capsys):
    """An accelerate-style loop calls step_done(loss=...) only: its records, progress lines and summary leave
    samples/s out (None), never 0.0."""
    from orchestrator.report.summary import build_summary

    model, optim = build()
    with session_at(tmp_path, every_n_steps=0) as session:
        session.register(model=model, optim=optim)
        session.restore()
        for _ in session.steps():
            loss = model(torch.ones(2, 4)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            session.step_done(loss=loss)
    records = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [2, 4, 6] and all(r["samples_per_s"] is None for r in records)
    printed = capsys.readouterr().out
    assert "[rank0] step 6/6 loss " in printed and "samples/s" not in printed, printed
    assert build_summary(tmp_path)["samples_per_s"] is None
