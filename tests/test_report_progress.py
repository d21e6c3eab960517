"""Live progress: tailing the run dir's files, the line it shows, plain output when not on a terminal."""

from __future__ import annotations

import io
import json
import time

import pytest

from orchestrator.rundir import JsonlTail
from orchestrator.report.progress import ProgressState, RunProgress, use_live_display
from orchestrator.rundir import append_jsonl

pytestmark = pytest.mark.timeout(30)


def test_tail_returns_only_complete_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1})
    tail = JsonlTail(path)  # from the end: an earlier launch's lines are not shown again
    assert tail.read_new() == []
    with path.open("a") as f:
        f.write(json.dumps({"step": 2}) + "\n" + '{"step": 3')
    assert tail.read_new() == [{"step": 2}]
    with path.open("a") as f:
        f.write("}\n")
    assert tail.read_new() == [{"step": 3}]
    assert JsonlTail(tmp_path / "absent.jsonl").read_new() == []


def test_state_line_has_step_loss_throughput_world_eta_and_last_event():
    state = ProgressState(max_steps=100, started_t=0.0)
    assert state.line(now=3.0) == "starting (3 s)"
    state.update([{"t": 10.0, "step": 10, "loss": 5.0, "samples_per_s": 300.0, "world_size": 2, "step_time_s": 0.1},
                  {"t": 12.0, "step": 20, "loss": 4.5, "samples_per_s": 320.0, "world_size": 2, "step_time_s": 0.2}],
                 [{"t": 11.0, "event": "node_lost", "node": 1}])
    assert state.eta_s == pytest.approx(16.0)  # 80 steps left at 5 steps/s
    assert state.line(now=14.0) == ("step 20/100 (20%), loss 4.5000, 320.0 samples/s, world 2, ETA 16 s, "
                                    "last: node_lost (node 1) 3 s ago")
    state.update([], [{"t": 13.0, "event": "rendezvous_complete", "world_size": 1}])
    assert state.world_size == 1


def test_plain_lines_when_not_a_terminal_at_most_every_interval(tmp_path, monkeypatch):
    out = io.StringIO()
    assert not use_live_display(out)
    monkeypatch.setenv("CI", "true")
    assert not use_live_display(type("Tty", (io.StringIO,), {"isatty": lambda self: True})())
    with RunProgress(str(tmp_path), 40, out, interval_s=0.3, poll_s=0.05) as progress:
        assert progress.echo is out, "node output goes straight to the stream"
        for step in (5, 10, 15):
            append_jsonl(tmp_path / "metrics.jsonl", {"t": time.time(), "step": step, "loss": 5.0,
                                                      "samples_per_s": 100.0, "world_size": 2, "step_time_s": 0.05})
            time.sleep(0.12)
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1].startswith("[orch] step 15/40 (38%), loss 5.0000, 100.0 samples/s, world 2")


def test_live_display_keeps_node_output_and_ends_with_the_last_state(tmp_path):
    out = io.StringIO()
    with RunProgress(str(tmp_path), 40, out, live=True, poll_s=0.05) as progress:
        progress.echo.write("[node0] hello from a worker\n")
        append_jsonl(tmp_path / "metrics.jsonl", {"t": time.time(), "step": 40, "loss": 4.0, "samples_per_s": 90.0,
                                                  "world_size": 1, "step_time_s": 0.05})
    text = out.getvalue()
    assert "[node0] hello from a worker" in text
    assert "step 40/40 (100%)" in text


def test_a_user_scripts_total_comes_from_its_worker_started():
    """A user script (no trainer.max_steps known to the launch): its session's or HF's max_steps, in
    worker_started, gives the line its total, percentage and ETA."""
    from orchestrator.report.progress import ProgressState

    state = ProgressState(max_steps=None, started_t=0.0)
    state.update([], [{"t": 1.0, "event": "worker_started", "world_size": 2, "restart_count": 0, "step": 0,
                       "max_steps": 100}])
    state.update([{"t": 2.0, "step": 10, "loss": 1.0, "world_size": 2, "step_time_s": 0.5},
                  {"t": 7.0, "step": 20, "loss": 0.9, "world_size": 2, "step_time_s": 0.5}], [])
    line = state.line(now=8.0)
    assert line.startswith("step 20/100 (20%), loss 0.9000, world 2, ETA 40 s"), line


def test_the_eta_after_a_restart_comes_from_the_new_attempts_step_time_not_the_gap():
    from orchestrator.report.progress import ProgressState

    state = ProgressState(max_steps=3000, started_t=0.0)
    state.update([{"t": 10.0, "step": 190, "world_size": 2, "restart_count": 0, "step_time_s": 0.01},
                  {"t": 40.0, "step": 200, "world_size": 2, "restart_count": 1, "step_time_s": 0.01}], [])
    assert state.eta_s == 28.0, "2800 steps at the new attempt's 10 ms, not 10 steps per 30 s of restart"


def test_a_terminal_gets_a_progress_bar_once_the_total_is_known():
    import io

    from rich.console import Console

    from orchestrator.report.progress import ProgressState, render_live

    def shown(state: ProgressState) -> str:
        out = io.StringIO()
        Console(file=out, width=160, force_terminal=True, color_system=None).print(render_live(state))
        return out.getvalue()

    state = ProgressState(max_steps=None, started_t=0.0)
    assert "━" not in shown(state) and "starting" in shown(state)
    state.update([{"t": 1.0, "step": 50, "loss": 1.0, "world_size": 2, "step_time_s": 0.1}],
                 [{"t": 0.5, "event": "worker_started", "world_size": 2, "restart_count": 0, "step": 0,
                   "max_steps": 100}])
    text = shown(state)
    assert "━" in text and "step 50/100 (50%)" in text, text
