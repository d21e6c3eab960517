"""orchestrator.integrations.hf: the Trainer callback's decisions in-process (real TrainerState/TrainerControl, no
Trainer, no processes), and one real launch of examples/hf_trainer.py preempted mid-run."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

import orchestrator.elastic as elastic  # noqa: E402
from orchestrator.errors import ConfigError  # noqa: E402
from orchestrator.integrations import hf  # noqa: E402
from orchestrator.preemption.notices import Notice  # noqa: E402
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, read_jsonl  # noqa: E402
from orchproc import REPO, launch_and_preempt, run_orch, start_orch, stop_tree, summary, wait_for  # noqa: E402


@pytest.fixture(autouse=True)
def _plain_process(outside_torchrun):
    """Every test here runs as a plain process (tests/conftest.py: outside_torchrun)."""


def run_config(run_dir: Path, *overrides: str):
    from orchestrator.config.compose import compose_config
    from orchestrator.launch import write_config

    cfg = compose_config("cpu_elastic", ["trainer.max_steps=40", "checkpoint.every_n_steps=10", "trainer.log_every=2",
                                         "preemption.sources=[sigterm,chaos]", f"run.dir={run_dir}", *overrides])
    write_config(cfg, str(run_dir))
    return cfg


def started(run_dir: Path, monkeypatch, global_step: int = 0):
    """A callback of an orch run in ``run_dir`` after ``on_train_begin``, with HF's state and control."""
    run_config(run_dir)
    monkeypatch.setenv("ORCH_RUN_DIR", str(run_dir))
    args = hf.orch_training_args()
    callback = hf.OrchCallback()
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = global_step, args.max_steps
    callback.on_train_begin(args, state, control)
    return callback, args, state, control


def step(callback, args, state, control, loss: float | None = None) -> TrainerControl:
    """One optimizer step as the Trainer drives its callbacks (DefaultFlowCallback's save decision included)."""
    control.should_save = control.should_log = False
    callback.on_step_begin(args, state, control)
    state.global_step += 1
    if state.global_step % args.save_steps == 0:
        control.should_save = True
    callback.on_step_end(args, state, control)
    if loss is not None:
        callback.on_log(args, state, control, logs={"loss": loss, "learning_rate": 1e-3})
    return control


def hf_save(args, state) -> Path:
    """What HF's _save_checkpoint leaves behind (the files the marker vouches for)."""
    folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": state.global_step}))
    return folder


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / EVENTS_FILE)


@pytest.mark.slow
def test_import_orchestrator_does_not_import_transformers():
    code = ("import sys, orchestrator, orchestrator.elastic, orchestrator.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_training_args_come_from_the_run_config_unless_given(tmp_path, monkeypatch):
    cfg = run_config(tmp_path, "checkpoint.keep_last=3")
    args = hf.orch_training_args(cfg, learning_rate=5e-4, logging_steps=7)
    assert args.output_dir == str(tmp_path / "checkpoints" / "hf")
    assert (args.max_steps, args.save_steps, args.save_total_limit) == (40, 10, 3)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 6), "global batch 24 at world 1"
    assert (args.learning_rate, args.logging_steps, args.use_cpu) == (5e-4, 7, True), "kwargs win"
    assert [hf.accumulation_steps(cfg, world) for world in (2, 3, 5)] == [3, 2, None], "global batch 24 kept"
    remote = run_config(tmp_path, "checkpoint.url=s3://bucket/ckpt")
    with pytest.raises(ValueError, match="filesystem path only"):
        hf.orch_training_args(remote)
    assert hf.orch_training_args(None, output_dir=str(tmp_path / "o")).max_steps == -1, "outside orch: HF's defaults"
    # What the Trainer's own loop cannot follow is refused in one line, naming key, value and fix.
    for override, key in (("checkpoint.every_n_steps=auto", "checkpoint.every_n_steps"),
                          ("parallelism=fsdp2", "parallelism.strategy")):
        with pytest.raises(ConfigError, match=f"{key}=.*Fix: "):
            hf.orch_training_args(run_config(tmp_path, override))
    with pytest.raises(ConfigError, match="parallelism.strategy='hsdp' is not applied by the transformers.Trainer"):
        hf.OrchCallback(cfg=run_config(tmp_path, "parallelism=hsdp"))
    # per_step: the arguments are the same; the callback in a plain Trainer refuses it, naming OrchTrainer.
    per_step = run_config(tmp_path, "fault_tolerance.mode=per_step")
    assert hf.orch_training_args(per_step).max_steps == 40
    callback = hf.OrchCallback(run_dir=str(tmp_path), cfg=per_step)
    with pytest.raises(ConfigError, match=r"fault_tolerance.mode='per_step' needs OrchTrainer.*Fix: build it as "
                                          r"orchestrator.integrations.hf.OrchTrainer"):
        callback.on_train_begin(hf.orch_training_args(per_step), TrainerState(), TrainerControl())


def test_only_complete_checkpoints_are_resumed_from(tmp_path):
    assert hf.latest_checkpoint(str(tmp_path / "missing")) is None
    for n in (5, 10, 15):
        (tmp_path / f"checkpoint-{n}").mkdir()
    (tmp_path / "checkpoint-5" / hf.COMPLETE_MARKER).write_text("{}")
    (tmp_path / "checkpoint-10" / hf.COMPLETE_MARKER).write_text("{}")
    assert hf.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10"), "15 was cut short: not complete"


@pytest.mark.timeout(60)
def test_a_periodic_save_is_unmarked_while_written_and_marked_after(tmp_path, monkeypatch):
    callback, args, state, control = started(tmp_path, monkeypatch, global_step=9)
    stale = hf_save(args, TrainerState(global_step=10))
    (stale / hf.COMPLETE_MARKER).write_text("{}")  # from an earlier attempt that got further
    control = step(callback, args, state, control)
    assert control.should_save and not control.should_training_stop
    assert not (stale / hf.COMPLETE_MARKER).exists(), "being written again: not complete until marked"
    hf_save(args, state)
    callback.on_save(args, state, control)
    assert hf.latest_checkpoint(args.output_dir) == str(stale)
    assert json.loads((stale / hf.COMPLETE_MARKER).read_text())["reason"] == "periodic"
    saved = [e for e in events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert [(e["step"], e["reason"]) for e in saved] == [(10, "periodic")]
    loaded = [e for e in events(tmp_path) if e["event"] == "checkpoint_loaded"]
    assert [e["step"] for e in loaded] == [9], "resumed at step 9"


@pytest.mark.timeout(60)
def test_a_notice_saves_this_step_marks_it_and_leaves_with_75(tmp_path, monkeypatch):
    callback, args, state, control = started(tmp_path, monkeypatch)
    step(callback, args, state, control)
    callback.preemption.watcher.notice = Notice("chaos", "test notice")
    control = step(callback, args, state, control)
    assert control.should_save and control.should_training_stop, "HF saves step 2 now, then stops"
    folder = hf_save(args, state)
    with pytest.raises(elastic.PreemptedExit) as exit_:
        callback.on_save(args, state, control)
    assert exit_.value.code == elastic.PREEMPTED_EXIT_CODE == 75 and exit_.value.step == 2
    assert json.loads((folder / hf.COMPLETE_MARKER).read_text())["reason"] == "preemption", "marked before leaving"
    seen = events(tmp_path)
    notice = next(e for e in seen if e["event"] == "preemption_notice")
    assert (notice["source"], notice["step"]) == ("chaos", 2)
    assert [e["step"] for e in seen if e["event"] == "emergency_checkpoint"] == [2]


@pytest.mark.timeout(60)
def test_a_torchrun_restart_leaves_at_the_boundary_without_saving(tmp_path, monkeypatch):
    callback, args, state, control = started(tmp_path, monkeypatch, global_step=9)

    class Left(Exception):
        pass

    def leave(wait_s):
        raise Left(wait_s)

    callback.preemption.watcher.restart_requested = True  # a SIGTERM that is no notice
    monkeypatch.setattr(callback.preemption.watcher, "leave_for_restart", leave)
    with pytest.raises(Left):
        step(callback, args, state, control)  # step 10 would be a periodic save: the worker leaves before it
    assert callback.leaving is None and not (Path(args.output_dir) / "checkpoint-10").exists()
    assert not [e for e in events(tmp_path) if e["event"] in ("checkpoint_saved", "emergency_checkpoint")]


@pytest.mark.timeout(60)
def test_metrics_records_and_goodput_events(tmp_path, monkeypatch):
    callback, args, state, control = started(tmp_path, monkeypatch)
    for i in range(4):
        control = step(callback, args, state, control, loss=2.0 - i if state.global_step % 2 == 1 else None)
    model = __import__("torch").nn.Linear(2, 1)
    callback.on_train_end(args, state, control, model=model)
    metrics = read_jsonl(tmp_path / METRICS_FILE)
    assert [m["step"] for m in metrics] == [2, 4] and [m["loss"] for m in metrics] == [1.0, -1.0]
    for m in metrics:
        assert {"t", "step", "loss", "lr", "world_size", "samples_per_s", "step_time_s", "last_step_time_s",
                "restart_count"} <= set(m)
        assert m["world_size"] == 1 and m["lr"] == 1e-3 and m["samples_per_s"] > 0
    names = [e["event"] for e in events(tmp_path)]
    assert names.index("rendezvous_complete") < names.index("worker_started") < names.index("first_step")
    finished = next(e for e in events(tmp_path) if e["event"] == "training_finished")
    assert finished["steps_completed"] == 4 and finished["final_loss"] == -1.0 and len(finished["params_sha256"]) == 64


def test_a_model_that_averages_its_own_loss_is_found_and_marked(tmp_path, monkeypatch, capsys):
    """BertForMaskedLM takes **kwargs but averages its loss itself: transformers would scale its loss and gradients
    by world x accumulation. The callback warns with the fix; averages_its_own_loss is the fix."""
    from transformers import BertConfig, BertForMaskedLM
    from transformers.utils import logging as hf_logging

    bert = BertForMaskedLM(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                      intermediate_size=8, max_position_embeddings=4))
    assert hf._loss_scaled_by_trainer(bert) and not hf._loss_scaled_by_trainer(__import__("torch").nn.Linear(2, 1))
    try:
        callback, args, state, control = started(tmp_path, monkeypatch)
        assert not hf_logging.is_progress_bar_enabled(), "under orch: no tqdm bars in the worker's log"
        callback.on_train_begin(args, state, control, model=bert)
        assert "scales its loss and gradients by 6" in capsys.readouterr().err, "world 1 x accumulation 6"
        callback.on_train_begin(args, state, control, model=hf.averages_its_own_loss(bert))
        assert "warning" not in capsys.readouterr().err and not hf._loss_scaled_by_trainer(bert)
    finally:
        hf_logging.enable_progress_bar()


# -- the example under orch -------------------------------------------------------------------------------------

HF_STEPS = 200


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_hf_example_survives_a_preemption_with_every_step_once(tmp_path):
    """examples/hf_trainer.py on two simulated nodes, `orch chaos preempt` of node 1 mid-run: an emergency HF
    checkpoint, a resume from it, and HF's global_step ends at max_steps with no step trained twice."""
    run_dir = launch_and_preempt(tmp_path, "examples/hf_trainer.py", HF_STEPS, 50, preempt_at_step=15)
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == HF_STEPS
    assert s["goodput"] and s["goodput"]["lost_steps"] == 0, s["goodput"]
    assert s["preemptions"] >= 1 and [r["cause"] for r in s["recoveries"]] == ["node_preempted"], s["recoveries"]
    seen = read_jsonl(run_dir / EVENTS_FILE)
    emergency = [e["step"] for e in seen if e["event"] == "emergency_checkpoint"]
    assert len(emergency) == 1 and emergency[0] < HF_STEPS, "the notice came mid-run"
    assert [e["step"] for e in seen if e["event"] == "checkpoint_loaded"] == emergency, "resumed from it"
    final = hf.latest_checkpoint(str(run_dir / "checkpoints" / "hf"))
    assert final is not None and final.endswith(f"checkpoint-{HF_STEPS}")
    assert json.loads((Path(final) / "trainer_state.json").read_text())["global_step"] == HF_STEPS
    metrics = read_jsonl(run_dir / METRICS_FILE)
    assert sorted(m["step"] for m in metrics) == list(range(1, HF_STEPS + 1)), "every step trained exactly once"
    # The loss is HF's standalone one at world 2 x accumulation 3: the same first loss as `python
    # examples/hf_trainer.py` (world 1, no accumulation), and no record scaled (before or after the recovery).
    standalone = subprocess.run([sys.executable, "examples/hf_trainer.py", "--output-dir", str(tmp_path / "alone"),
                                 "--max-steps", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    alone = float(re.search(r"'train_loss': '?([0-9.]+)", standalone.stdout + standalone.stderr).group(1))
    first = next(m["loss"] for m in metrics if m["step"] == 1)
    assert abs(first - alone) <= 0.1 * alone, (first, alone)
    assert max(m["loss"] for m in metrics) <= 1.1 * alone, "no record scaled by world x accumulation"
    log = (tmp_path / "orch.log").read_text()
    assert "EADDRINUSE" not in log and "address already in use" not in log.lower(), "no port collided on recovery"
    assert "Writing model shards" not in log, "HF's tqdm bars stay out of the worker logs"
    assert "preemptions 1" in log and "recoveries 1: MTTR" in log, log[-1500:]  # the printed summary says so


ACCELERATE_SCRIPT = '''
import sys, time
import torch
import orchestrator.elastic as elastic
from accelerate import Accelerator

run_dir, max_steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
optim = torch.optim.SGD(net.parameters(), lr=0.1)
model, optim = accelerator.prepare(net, optim)
with elastic.init(run_dir=run_dir, max_steps=max_steps, every_n_steps=2, checkpoint_url=f"{run_dir}/ckpt") as session:
    session.register(model=accelerator.unwrap_model(model), optim=optim)
    print("restored", session.restore(), flush=True)
    for step in session.steps():
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        optim.step(); optim.zero_grad()
        session.step_done(loss=loss)
        print("step", step, flush=True)
        time.sleep(pause)
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_accelerate_loop_with_the_documented_session_saves_on_sigterm_and_resumes(tmp_path):
    """docs/integrations.md's accelerate snippet, for real (one process): SIGTERM -> emergency checkpoint of the
    step in hand -> exit 75; the next run restores that step and trains only what is missing."""
    import signal
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    from orchestrator.processes import kill_tree

    script, run_dir = tmp_path / "acc_train.py", tmp_path / "run"
    script.write_text(ACCELERATE_SCRIPT)

    def run(max_steps: int, pause: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(run_dir), str(max_steps), str(pause)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = run(4, 0.0)
    out = first.communicate(timeout=120)[0]
    assert first.returncode == 0 and "restored 0" in out and "step 4" in out, out
    second = run(8, 0.5)
    try:
        lines = []
        for line in second.stdout:
            lines.append(line)
            if line.startswith("step 5"):
                second.send_signal(signal.SIGTERM)
                break
        rest = second.communicate(timeout=60)[0]
    finally:
        kill_tree(second.pid)
    assert second.returncode == 75, "".join(lines) + rest
    saved = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    assert "step_000000005" in saved or "step_000000006" in saved, saved
    third = run(8, 0.0)
    out = third.communicate(timeout=120)[0]
    resumed = int(next(line.split()[1] for line in out.splitlines() if line.startswith("restored")))
    assert third.returncode == 0 and resumed in (5, 6), out
    assert f"step {resumed + 1}" in out and f"step {resumed}\n" not in out, "only the missing steps are trained"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_accumulation_under_orch_trains_the_standalone_curve(tmp_path, monkeypatch):
    """Gradients, not only the logged loss: the example's model under orch's arguments at world 1 (accumulation
    6 x micro 4, from cpu_elastic's global batch 24) trains the same loss curve as one batch of 24 without
    accumulation (the same samples in the same order), step for step. Before averages_its_own_loss, each
    step's loss and gradients were 6 x as large and the curve differed."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, Trainer

    sys.path.insert(0, str(REPO / "examples"))
    from hf_trainer import SEQ, VOCAB, SyntheticTokens

    def curve(**args) -> list[float]:
        torch.manual_seed(0)
        model = hf.averages_its_own_loss(BertForMaskedLM(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))  # no RNG
        trainer = Trainer(model=model, args=TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=6, logging_steps=1, learning_rate=1e-3, save_strategy="no",
            report_to="none", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0, **args),
            train_dataset=SyntheticTokens(num_samples=256))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    monkeypatch.setenv("ORCH_RUN_DIR", str(tmp_path))
    run_config(tmp_path)
    orch = hf.orch_training_args()
    assert (orch.per_device_train_batch_size, orch.gradient_accumulation_steps) == (4, 6)
    under_orch = curve(per_device_train_batch_size=4, gradient_accumulation_steps=6)
    standalone = curve(per_device_train_batch_size=24, gradient_accumulation_steps=1)
    assert under_orch == pytest.approx(standalone, rel=1e-4), (under_orch, standalone)
    assert 4.0 < under_orch[0] < 5.5, "a first loss near ln(128), not 6 x it"


# -- per_step: OrchTrainer's loop through the quorum ---------------------------------------------------------------

# The returning node's start-up (15-30 s) is most of the test; node 0 trained 180-450 steps alone meanwhile here.
HF_PER_STEP_STEPS = 800


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_hf_example_per_step_survives_a_killed_node_which_heals_from_a_peer(tmp_path):
    """examples/hf_trainer.py (OrchTrainer) under fault_tolerance.mode=per_step on 1..2 simulated nodes, node 1
    SIGKILLed (`orch chaos kill-node`) once both groups train together: node 0 trains on alone without a restart,
    node 1's new agent heals from node 0 (replica_healed, bit-identical), and the run commits every step once at
    the global batch of cpu_elastic (24), with the job's loss in every record."""
    from orchestrator.ft import torchft_problem

    if torchft_problem() is not None:
        pytest.skip(str(torchft_problem()))
    run_dir, log = tmp_path / "run", tmp_path / "orch.log"
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2",
                      "fault_tolerance.mode=per_step", "entrypoint.script=examples/hf_trainer.py",
                      f"trainer.max_steps={HF_PER_STEP_STEPS}", "trainer.log_every=1", "checkpoint.every_n_steps=200",
                      f"run.dir={run_dir}", log=log)
    events = lambda: read_jsonl(run_dir / EVENTS_FILE)  # noqa: E731
    try:
        def together() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            return any(e["event"] == "quorum_changed" and e["replicas"] == 2 for e in events())

        wait_for(together, 240, "both replica groups in the quorum")
        killed_at = max((m["step"] for m in read_jsonl(run_dir / METRICS_FILE)), default=0)
        before_kill = time.time()
        kill = run_orch("chaos", "kill-node", str(run_dir), "--node", "1", timeout=30)
        assert kill.returncode == 0, kill.stderr

        def healed() -> list[dict]:
            assert proc.poll() is None, "the run ended before node 1 came back: " + log.read_text()[-3000:]
            return [e for e in events() if e["event"] == "replica_healed" and e["node"] == 1
                    and e["t"] > before_kill]

        wait_for(healed, 240, "the returning node 1 healing from node 0")
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        stop_tree(proc.pid)

    evs = read_jsonl(run_dir / EVENTS_FILE)
    killed = next(e["t"] for e in evs if e["event"] == "chaos_kill")
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == HF_PER_STEP_STEPS, s
    # The survivor never restarted: no torchrun restart, nothing read from storage, and it went on alone.
    unexpected = [e for e in evs if e["event"] in ("restart", "checkpoint_loaded", "worker_failed")]
    assert not unexpected, (unexpected, log.read_text()[-3000:])
    shrink = next(e for e in evs if e["event"] == "quorum_changed" and e["t"] > killed)
    assert shrink["replicas"] == 1 and shrink["step"] > killed_at, shrink
    healed = next(e for e in evs if e["event"] == "replica_healed" and e["t"] > killed)
    assert healed["node"] == 1 and healed["source_node"] == 0 and healed["checkpoint_read"] is False
    assert healed["params_sha256"] == healed["source_params_sha256"] and healed["step"] > shrink["step"]
    grown = [e for e in evs if e["event"] == "quorum_changed" and e["t"] > healed["t"]]
    assert grown and grown[0]["replicas"] == 2 and grown[0]["step"] == healed["step"] + 1, grown
    metrics = read_jsonl(run_dir / METRICS_FILE)
    assert sorted(m["step"] for m in metrics) == list(range(1, HF_PER_STEP_STEPS + 1)), "every step committed once"
    alone = [m for m in metrics if shrink["step"] <= m["step"] <= healed["step"]]
    assert alone and {m["world_size"] for m in alone} == {1}, "node 0 trained on alone"
    assert {m["world_size"] for m in metrics if m["step"] > healed["step"]} == {2}
    # The global batch stayed 24 at both sizes (accumulation 6 alone, 3 each together), and the loss is the
    # job's: near ln(128) at the start, never world x accumulation times too large.
    assert s["goodput"]["lost_steps"] == 0, s["goodput"]
    assert 4.0 < metrics[0]["loss"] < 5.5 and max(m["loss"] for m in metrics) < 5.5, metrics[0]


class _DiscardOnce:
    """per_step's step protocol for one group without a quorum service: the optimizer steps only on commit
    (ft/replica.py's wrap_for_commit) and step ``discard`` is discarded once, as when a peer dies in its all-reduce,
    its state put back by ReplicaGroup's own snapshot code (scheduler, records, buffers, RNG)."""

    def __init__(self, discard: int | None):
        from orchestrator.ft.replica import ReplicaGroup

        self.discard, self.device, self.state = discard, __import__("torch").device("cpu"), None
        self.attempts: list[int] = []
        self.committed, self._began = None, False
        self._take_snapshot = ReplicaGroup._take_snapshot.__get__(self)
        self._restore_snapshot = ReplicaGroup._restore_snapshot.__get__(self)

    def __getattr__(self, name):  # everything else as in restart mode
        from orchestrator.ft.steps import RestartSteps

        return getattr(RestartSteps(), name)

    def attach(self, state, emit, window):
        from orchestrator.ft.replica import wrap_for_commit

        self.state = state
        wrap_for_commit(state, self)
        return self

    def membership(self):
        return lambda: (1, 0, self.state.progress.samples_consumed)

    def begin_step(self):
        if not self._began:
            self._began, self.committed, self._snapshot = True, None, self._take_snapshot()

    def commit(self) -> bool:
        if self.committed is None:
            step = self.state.progress.step + 1
            self.committed = step != self.discard or step in self.attempts
            self.attempts.append(step)
        return self.committed

    def end_step(self) -> bool:
        committed = self.commit()
        if not committed:
            self._restore_snapshot()
        self._began = False
        return committed


@pytest.mark.timeout(120)
def test_orch_trainer_per_step_loop_trains_a_discarded_step_again_without_advancing_anything(tmp_path, monkeypatch):
    """OrchTrainer's per_step loop in one process (the quorum replaced by a protocol that discards step 3 once):
    the discarded attempt moves neither global_step, the scheduler, the data position nor the RNG (dropout on), so
    the run ends bit-identical to one without the discard, with the same records, on_step_end once per step, and
    step 3's samples drawn again."""
    pytest.importorskip("torchft")
    import torch
    from transformers import BertConfig, BertForMaskedLM, TrainerCallback

    from orchestrator.runtime.state import params_sha256

    sys.path.insert(0, str(REPO / "examples"))
    from hf_trainer import SEQ, VOCAB, SyntheticTokens

    class Drawn(SyntheticTokens):
        def __init__(self):
            super().__init__(num_samples=240)
            self.ids_drawn: list[int] = []

        def __getitem__(self, index):
            self.ids_drawn.append(index)
            return super().__getitem__(index)

    class Steps(TrainerCallback):
        def __init__(self):
            self.ended: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ended.append(state.global_step)

    def train(discard: int | None, run_dir: Path):
        cfg = run_config(run_dir, "fault_tolerance.mode=per_step", "trainer.max_steps=6", "trainer.log_every=1")
        protocol = _DiscardOnce(discard)
        monkeypatch.setattr("orchestrator.elastic.session.step_protocol", lambda *a: protocol)
        torch.manual_seed(0)
        model = hf.averages_its_own_loss(BertForMaskedLM(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=SEQ)))  # dropout on: the RNG must be put back too
        data, steps = Drawn(), Steps()
        trainer = hf.OrchTrainer(model=model, args=hf.orch_training_args(cfg, learning_rate=1e-3, warmup_steps=2),
                                 train_dataset=data, callbacks=[hf.OrchCallback(str(run_dir), cfg), steps],
                                 cfg=cfg, run_dir=str(run_dir))
        out = trainer.train()
        records = read_jsonl(run_dir / METRICS_FILE)
        return trainer, out, data.ids_drawn, steps.ended, records, protocol.attempts

    plain, out, drawn, ended, records, attempts = train(None, tmp_path / "plain")
    assert attempts == [1, 2, 3, 4, 5, 6] and out.global_step == 6 and ended == [1, 2, 3, 4, 5, 6]
    assert not any(isinstance(c, hf.OrchCallback) for c in plain.callback_handler.callbacks), "the session does it"
    again, out2, drawn2, ended2, records2, attempts2 = train(3, tmp_path / "again")
    assert attempts2 == [1, 2, 3, 3, 4, 5, 6] and out2.global_step == 6 and ended2 == [1, 2, 3, 4, 5, 6]
    per_step = len(drawn) // 6  # the global batch, 24: micro 4 x accumulation 6 at world 1
    assert per_step == 24 and drawn2 == drawn[:3 * per_step] + drawn[2 * per_step:], "step 3's samples again"
    assert again.lr_scheduler.last_epoch == plain.lr_scheduler.last_epoch == 6
    assert [(r["step"], r["loss"], r["lr"]) for r in records2] == [(r["step"], r["loss"], r["lr"]) for r in records]
    assert params_sha256(again.model) == params_sha256(plain.model), "the discard left nothing behind"
    assert 4.0 < records[0]["loss"] < 5.5, "a first loss near ln(128): the loss is not scaled by accumulation"
    finished = [e for e in read_jsonl(tmp_path / "again" / EVENTS_FILE) if e["event"] == "training_finished"]
    assert [e["steps_completed"] for e in finished] == [6]
