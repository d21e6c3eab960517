"""The worker side of a fault-tolerance mode (orchestrator/ft/steps.py) and the training state's one serializer
(orchestrator/runtime/state.py), in process: the session calls the protocol at the same points whatever the
mode, and a discarded step is trained again."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import orchestrator.elastic as elastic
from orchestrator.config.extras import torchft_problem
from orchestrator.ft.steps import RestartSteps, StepProtocol
from orchestrator.ft.worker import step_protocol
from orchestrator.rundir import EVENTS_FILE, read_jsonl
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Progress, Record, RngState, TrainingState

SOLO = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, restart_count=0)
HOOKS = [name for name, value in vars(StepProtocol).items() if inspect.isfunction(value) and not name.startswith("_")]


@pytest.fixture(autouse=True)
def _plain_process(outside_torchrun):
    """Every test here runs as a plain process (tests/conftest.py: outside_torchrun)."""


class Scripted(RestartSteps):
    """Restart mode's no-ops, recording each call; ``discard`` lists the attempts (1-based) whose step it
    discards."""

    def __init__(self, discard: tuple[int, ...] = ()):
        self.calls: list[str] = []
        self.discard, self.attempts = discard, 0

    def __getattribute__(self, name: str):
        if name in HOOKS:
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def end_step(self) -> bool:
        self.attempts += 1
        return self.attempts not in self.discard


def test_every_mode_implements_the_whole_protocol():
    from orchestrator.ft.replica import PerStepSteps, ReplicaGroup

    assert {"attach", "heal", "restored", "membership", "begin_step", "end_step", "window_rolled",
            "sync_gradients", "peers_hold_state", "shutdown"} <= set(HOOKS)
    for cls in (RestartSteps, PerStepSteps, ReplicaGroup):
        for name in HOOKS:
            expected = list(inspect.signature(getattr(StepProtocol, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == expected, (cls.__name__, name)


def test_restart_mode_is_picked_without_orchs_quorum_service(monkeypatch):
    from orchestrator.config.schema import FaultToleranceConfig, OrchConfig

    cfg = OrchConfig(preset="t", fault_tolerance=FaultToleranceConfig(mode="per_step"))
    monkeypatch.delenv("ORCH_FT_QUORUM", raising=False)
    assert isinstance(step_protocol(None, SOLO, torch.device("cpu")), RestartSteps)
    assert type(step_protocol(cfg, SOLO, torch.device("cpu"))) is RestartSteps  # a bare torchrun: no quorum
    events: list[tuple[str, dict]] = []
    step_protocol(None, SOLO, torch.device("cpu")).record_start(lambda e, **f: events.append((e, f)), SOLO)
    assert [e for e, _ in events] == ["rendezvous_complete"]
    assert RestartSteps().sample_record(SOLO, 24, 1, 0) == ("rank0", {})


@pytest.mark.skipif(torchft_problem() is not None, reason=str(torchft_problem()))
def test_per_step_is_picked_under_orchs_launcher_and_records_its_own_round(monkeypatch):
    from orchestrator.config.schema import FaultToleranceConfig, OrchConfig
    from orchestrator.ft.replica import PerStepSteps

    monkeypatch.setenv("ORCH_FT_QUORUM", "127.0.0.1:1")  # nothing is dialed before attach()
    mode = step_protocol(OrchConfig(preset="t", fault_tolerance=FaultToleranceConfig(mode="per_step")), SOLO,
                         torch.device("cpu"))
    assert isinstance(mode, PerStepSteps)
    events: list[tuple[str, dict]] = []
    mode.record_start(lambda e, **f: events.append((e, f)), SOLO)
    assert [e for e, _ in events] == ["replica_started"]
    assert mode.sample_record(SOLO, 24, 2, 1) == ("node0-rank0", {"start_sample": 24, "world_size": 2, "job_rank": 1})
    assert not mode.heal() and mode.end_step() and mode.membership() is None, "nothing to coordinate before attach"


@pytest.mark.timeout(60)
def test_the_session_calls_the_protocol_at_fixed_points_and_redoes_a_discarded_step(tmp_path):
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scripted = Scripted(discard=(2,))
    with elastic.Session(None, SOLO, str(tmp_path), max_steps=3, every_n_steps=0, log_every=1) as session:
        session.ft = scripted
        session.register(model=model, optim=optim)
        sampler = session.global_batch_sampler(64, global_batch=8, micro_batch=8)
        trained, committed = [], []
        for step, batch in zip(session.steps(), sampler):
            model(torch.ones(len(batch), 4)).sum().backward()
            session.sync_gradients()
            optim.step()
            optim.zero_grad()
            session.step_done(loss=1.0)
            trained.append(step)
            committed.append(session.committed)
    assert trained == [1, 2, 2, 3] and committed == [True, False, True, True], "step 2 was trained again"
    assert session.step == 3 and session.samples_consumed == 24, "a discarded step counts for nothing"
    attempt = ["begin_step", "sync_gradients", "end_step"]
    record = ["window_rolled", "mean_across_groups"]  # a metrics record closes a window; its means are the job's
    assert scripted.calls == ["attach", "notices", "heal", "restored", "membership",
                              *attempt, *record,  # step 1 (log_every=1)
                              *attempt,  # step 2, discarded: no record
                              *attempt, *record, *attempt, *record, "shutdown"]
    steps = [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    finished = [e for e in read_jsonl(tmp_path / EVENTS_FILE) if e["event"] == "training_finished"]
    assert finished[0]["steps_completed"] == 3


def test_one_serializer_for_checkpoints_and_healing():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    state = TrainingState(Progress(step=7, samples_consumed=56, epoch=1))
    state.register({"model": model, "optim": optim})
    window = {"steps": 3}
    records = {"_window": Record(lambda: dict(window), window.update), "_rng": RngState(torch.device("cpu"))}
    random.seed(5)
    sent = state.state_dict(world_size=2, records=records)
    assert sorted(sent) == ["_rng", "_window", "model", "optim", "trainer"]
    assert sent["trainer"] == {"step": 7, "samples_consumed": 56, "epoch": 1, "world_size": 2}
    expected_draw = random.random()

    torch.manual_seed(1)
    other, progress = nn.Linear(3, 2), Progress()
    receiver = TrainingState(progress)
    receiver.register({"model": other, "optim": torch.optim.AdamW(other.parameters())})
    got = {"steps": 0}
    receiver.load_state_dict(sent, {"_window": Record(dict, got.update), "_rng": RngState(torch.device("cpu"))})
    assert torch.equal(other.weight, model.weight) and (progress.step, progress.samples_consumed) == (7, 56)
    assert got == {"steps": 3} and random.random() == expected_draw, "the records came along"
    with pytest.raises(ValueError, match="clash"):
        state.state_dict(1, {"model": Record(dict, print)})


def test_a_checkpoint_keeps_its_payloads(tmp_path: Path):
    """A checkpoint is the serializer's dict plus every rank's RNG states: the payloads the built-in trainer's
    checkpoints have always had."""
    from orchestrator.checkpoint import CheckpointManager

    model = nn.Linear(4, 1)
    with elastic.Session(None, SOLO, str(tmp_path), max_steps=1, every_n_steps=0) as session:
        session.register(model=model)
        for _ in session.steps():
            session.step_done()
    loaded = CheckpointManager(str(tmp_path / "checkpoints")).load()
    assert sorted(loaded.state) == ["model", "rng", "trainer"]
    assert loaded.state["trainer"] == {"step": 1, "samples_consumed": 0, "epoch": 0, "world_size": 1}
    assert len(loaded.state["rng"]["per_rank"]) == 1


@pytest.mark.skipif(torchft_problem() is not None, reason=str(torchft_problem()))
def test_a_discarded_step_puts_back_the_learning_rate_its_scheduler_set():
    """A training loop that steps its scheduler whatever the commit said (the built-in trainer, most scripts): the
    discarded step's scheduler.step() set the next step's learning rate in the optimizer; the step goes back to
    where it began, so the redone step trains at its own rate, and a chained schedule (CosineAnnealingLR's
    recursive form) is on the same curve afterwards as a run without the discard."""
    import warnings
    from types import SimpleNamespace

    from orchestrator.ft.replica import ReplicaGroup, wrap_for_commit

    def run(discard: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainingState(Progress())
        state.register({"model": model, "optimizer": optimizer})
        fake = SimpleNamespace(state=state, device=torch.device("cpu"), attempts=0)
        fake.commit = lambda: not (discard and fake.attempts == 3)
        wrap_for_commit(state, fake)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the commit wrapper keeps torch's marks: no "step() was overridden"
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
        state.register({"scheduler": scheduler})
        lrs = []
        while fake.attempts < (7 if discard else 6):
            fake.attempts += 1
            fake._snapshot = ReplicaGroup._take_snapshot(fake)
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            scheduler.step()
            if not fake.commit():
                ReplicaGroup._restore_snapshot(fake)
        return lrs, model.weight.detach().clone()

    plain_lrs, plain_weight = run(discard=False)
    lrs, weight = run(discard=True)
    assert lrs[3] == lrs[2] == plain_lrs[2], "the redone step trains at its own rate"
    assert lrs[:3] + lrs[4:] == plain_lrs
    torch.testing.assert_close(weight, plain_weight, rtol=0, atol=0)
