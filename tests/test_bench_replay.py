"""``orch bench replay``: the trace (default and --trace, checked), the rows computed from step timelines, the
JSON, the table and the plot, with scripted legs (no processes); one cheap end-to-end run of the bare torchrun
leg under a two-event trace (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from orchestrator.bench import replay
from orchestrator.bench.replay_legs import RunResult
from orchestrator.bench.replay_trace import check_trace, default_trace, load_trace
from orchestrator.errors import UserError
from orchproc import orch_here, run_orch

ROW_KEYS = {"system", "wall_s", "wall_s_fault_free", "time_to_train_ratio", "lost_steps", "mttr_s", "steps_completed"}


def test_default_trace_is_seeded_valid_and_has_every_kind_early():
    trace = default_trace(seed=0, nodes=2)
    assert trace == default_trace(seed=0, nodes=2) and trace != default_trace(seed=1, nodes=2)
    check_trace(trace, 2)
    assert {e.kind for e in trace} == {"kill", "preempt", "return"}
    early = [e.kind for e in trace if e.t < 40]
    assert early[:3] == ["kill", "return", "preempt"], early
    assert 60 < trace[-1].t <= 180, "a few minutes"
    assert all(e.grace_s and e.grace_s > 0 for e in trace if e.kind == "preempt")


@pytest.mark.parametrize("content, names", [
    (None, "cannot read it"),
    ("{nope", "not JSON"),
    ('{"t": 1}', "expected a non-empty list"),
    ('[{"t": 1, "kind": "boom", "node": 0}]', "kind='boom' is not one of kill, preempt, return"),
    ('[{"t": 1, "kind": "kill", "node": 2}]', "node=2 is not a node of this bench (0..1)"),
    ('[{"t": -1, "kind": "kill", "node": 0}]', "t=-1 is not a number of seconds"),
    ('[{"t": 1, "kind": "kill", "node": 0, "why": 1}]', "unknown key(s) ['why']"),
    ('[{"t": 1, "kind": "return", "node": 0}]', "the node is up"),
    ('[{"t": 1, "kind": "kill", "node": 0}, {"t": 2, "kind": "kill", "node": 1}]', "would leave no node up"),
    ('[{"t": 5, "kind": "kill", "node": 0}, {"t": 2, "kind": "return", "node": 0}]', "comes before"),
    ('[{"t": 1, "kind": "preempt", "node": 0, "grace_s": 10}, {"t": 5, "kind": "return", "node": 0}]',
     "its preemption's deadline is t=11"),
])
def test_bad_trace_exits_2_with_one_line_naming_it(tmp_path, capsys, content, names):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as err:
        load_trace(str(path), nodes=2)
    assert names in str(err.value) and "Fix:" in str(err.value) and "\n" not in str(err.value)
    result = orch_here(capsys, "bench", "replay", "--trace", str(path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and names in result.stderr, result.stderr


def test_good_trace_file_reads_with_default_grace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([{"t": 2, "kind": "preempt", "node": 1}, {"t": 20, "kind": "return", "node": 1},
                                {"t": 25.5, "kind": "kill", "node": 0}]))
    trace = load_trace(str(path), nodes=2)
    assert [(e.t, e.kind, e.node, e.grace_s) for e in trace] == [(2.0, "preempt", 1, 10.0), (20.0, "return", 1, None),
                                                                 (25.5, "kill", 0, None)]


def test_systems_subset_and_unknown_name(capsys):
    assert replay.parse_systems(None) == list(replay.SYSTEMS)
    assert replay.parse_systems("ray-train,torchrun") == ["torchrun", "ray-train"]
    result = orch_here(capsys, "bench", "replay", "--systems", "torchrun,slurm")
    assert result.returncode == 2 and "'slurm' is not a system of this bench" in result.stderr
    assert "orch-per_step" in result.stderr


def timeline(start: float, pieces: list[tuple[float, float, int, int]]) -> list[tuple[float, int]]:
    """Steps ``a..b`` evenly from ``t0`` to ``t1`` for each piece ``(t0, t1, a, b)``, offset by ``start``."""
    out = []
    for t0, t1, a, b in pieces:
        n = b - a + 1
        out += [(start + t0 + (t1 - t0) * i / max(1, n - 1), a + i) for i in range(n)]
    return out


def test_rows_from_timelines():
    start = 1000.0
    quiet = RunResult(start, start + 32, timeline(start, [(2, 30, 1, 100)]))
    # A kill at t=12 (step 40 done at ~11.8): back at step 21 (a snapshot every 20) 10 s later, then a return.
    traced = RunResult(start, start + 60, timeline(start, [(2, 12, 1, 40), (22, 30, 21, 60), (35, 50, 61, 100)]),
                       [{"t": start + 12.5, "kind": "kill", "node": 1}, {"t": start + 31, "kind": "return", "node": 1},
                        {"t": start + 55, "kind": "kill", "node": 0}])  # after the last step: it reached nothing
    r = replay.row("torchrun", quiet, traced, max_steps=100)
    assert set(r) >= ROW_KEYS
    assert r["wall_s"] == 50.0 and r["wall_s_fault_free"] == 30.0 and r["time_to_train_ratio"] == 0.6
    assert r["lost_steps"] == 20 and r["steps_completed"] == 100 and r["events_applied"] == 2
    assert r["train_s"] == 48.0 and r["train_s_fault_free"] == 28.0
    assert r["mttr_s"] == [9.5, 4.0]  # 12.5 -> 22 (from the event); 30 -> 35 counted from the return at 31
    assert r["events"] == [{"t": 10.5, "kind": "kill", "node": 1}, {"t": 29.0, "kind": "return", "node": 1}]


def test_unfinished_run_counts_its_open_stall_and_its_end():
    start = 0.0
    quiet = RunResult(start, 20, timeline(start, [(1, 20, 1, 50)]))
    stuck = RunResult(start, 90, timeline(start, [(1, 10, 1, 30)]), [{"t": 10.5, "kind": "kill", "node": 0}],
                      finished=False)
    r = replay.row("ray-train", quiet, stuck, max_steps=50)
    assert r["steps_completed"] == 30 and r["wall_s"] == 90 and r["mttr_s"] == [79.5]
    assert r["time_to_train_ratio"] == round(20 / 90, 3)


def test_json_table_and_plot_with_scripted_legs(tmp_path, capsys):
    calls = []

    def leg(name, lost):
        def run(workdir, trace):
            calls.append((name, workdir.name, len(trace)))
            quiet = RunResult(0, 21, timeline(0, [(1, 20, 1, 40)]))
            pieces = [(1, 8, 1, 20), (10, 20, 21 - lost, 40)] if lost else [(1, 8, 1, 20), (9, 22, 21, 40)]
            return quiet, RunResult(0, 30, timeline(0, pieces), [{"t": 8.5, "kind": "kill", "node": 1}])
        return run

    legs = {s: leg(s, lost) for s, lost in zip(replay.SYSTEMS, (10, 5, 0, 20))}
    out = tmp_path / "replay.json"
    result = replay.main_replay_bench(str(out), None, None, max_steps=40, legs=legs)
    assert [c[0] for c in calls] == list(replay.SYSTEMS) and all(c[2] == len(default_trace()) for c in calls)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert [r["system"] for r in written["rows"]] == ["torchrun", "orch-restart", "orch-per_step", "ray-train"]
    assert all(set(r) >= ROW_KEYS and isinstance(r["mttr_s"], list) for r in written["rows"])
    assert [r["lost_steps"] for r in written["rows"]] == [10, 5, 0, 20]
    assert written["trace"][0] == {"t": 5.0, "kind": "kill", "node": 1}
    table = capsys.readouterr().out
    for name in replay.SYSTEMS:
        assert f"\n{name} " in table
    assert "time-to-train" in table and "MTTR s per event" in table
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bare_torchrun_leg_replays_a_kill_and_a_return(tmp_path):
    """The real torchrun leg, cheaply: 60 steps, node 1 killed 1 s into training and back 3 s later; the job
    finishes, both events reached it, and no process of the leg is left."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"t": 1, "kind": "kill", "node": 1}, {"t": 4, "kind": "return", "node": 1}]))
    out, work = tmp_path / "replay.json", tmp_path / "work"
    result = run_orch("bench", "replay", "--systems", "torchrun", "--trace", str(trace), "--max-steps", "60",
                      "--out", str(out), "--workdir", str(work), timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (r,) = json.loads(out.read_text())["rows"]
    assert r["system"] == "torchrun" and r["steps_completed"] == 60 and r["events_applied"] == 2, r
    assert len(r["mttr_s"]) == 2 and r["mttr_s"][0] > 0 and r["wall_s"] > 0 and r["wall_s_fault_free"] > 0
    lines = (work / "torchrun" / "trace" / "steps.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps[-1] == 60 and r["lost_steps"] == sum(a - (b - 1) for a, b in zip(steps, steps[1:]) if b < a)
    assert out.with_suffix(".png").exists() and "torchrun" in result.stdout
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(work) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes of the leg still running: {left}"


def test_a_notice_reaches_an_orch_agent_started_on_the_noticed_machine_before_its_deadline(tmp_path):
    """A cloud's notice is the machine's: orch's agent placed there after the notice still gets it, once, with the
    grace that is left; after the deadline (or the kill) nobody does."""
    from orchestrator.bench.replay_legs import OrchRun
    from orchestrator.preemption.notices import read_notice

    run = OrchRun("restart", "127.0.0.1:1", [], tmp_path)
    run.run_dir.mkdir(parents=True)
    events = run.run_dir / "events.jsonl"

    def joined(node, pid, ray_node):
        with events.open("a") as f:
            f.write(json.dumps({"t": 0, "event": "node_joined", "node": node, "pid": pid, "ray_node": ray_node}) + "\n")

    joined(0, 101, "other")
    run.notify(1, "doomed", grace_s=30)
    assert read_notice(run.run_dir, 0, 101) is None and not (run.run_dir / "notices").exists()
    joined(1, 202, "doomed")
    run.poll()
    run.poll()
    notice = read_notice(run.run_dir, 1, 202)
    assert notice is not None and notice.source == "chaos" and 25 < notice.grace_s <= 30
    chaos = [json.loads(line) for line in events.read_text().splitlines() if "chaos_preempt" in line]
    assert [(e["node"], e["agent_pid"]) for e in chaos] == [(1, 202)]
    run.killed("doomed", [202])
    joined(1, 303, "doomed")
    run.poll()
    assert read_notice(run.run_dir, 1, 303) is None
