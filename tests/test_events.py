"""The run's events as one contract: every name in ``EventName`` has one constructor in orchestrator/events.py,
docs/run-dir.md lists every event with every field, orch's sources write events only through the
constructors and read them by ``EventName`` member, never by a string of their own; the JSON is what orch
always wrote. Fast: reads sources and docs, starts nothing."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from orchestrator import events as ev
from orchestrator.rundir import EventLog, EventName, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "launchers").rglob("*.py")])
NAMES = {e.value for e in EventName}


def json_fields(cls: type[ev.Event]) -> list[str]:
    """The JSON keys a constructor writes (a spread field's keys are open: not listed)."""
    return [f.name.removesuffix("_") for f in dataclasses.fields(cls) if f.metadata.get("written") != "spread"]


def doc_rows() -> dict[str, str]:
    """docs/run-dir.md's table rows per event name (an event in several tables: its rows joined)."""
    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "run-dir.md").read_text().splitlines():
        match = re.match(r"^\| `([a-z_]+)` \|", line)
        if match and match.group(1) in NAMES:
            rows[match.group(1)] = rows.get(match.group(1), "") + line
    return rows


def test_every_name_has_one_constructor_with_a_docstring():
    assert set(ev.EVENT_TYPES) == set(EventName), "an EventName member without a constructor, or the reverse"
    for name, cls in ev.EVENT_TYPES.items():
        assert cls.event is name
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__
        doc = cls.__dict__.get("__doc__") or ""
        assert doc.strip() and doc != ev.Event.__doc__, f"{cls.__name__}: a line on what {name} means"


def test_every_event_and_every_field_is_in_docs_run_dir_md():
    rows = doc_rows()
    missing = sorted(set(NAMES) - set(rows))
    assert not missing, f"docs/run-dir.md has no table row for {missing}"
    for name, cls in ev.EVENT_TYPES.items():
        undocumented = [f for f in json_fields(cls) if f"`{f}`" not in rows[name]]
        assert not undocumented, f"docs/run-dir.md's `{name}` row does not name {undocumented}"


def test_sources_write_through_the_constructors_and_read_by_member():
    """No ``emit("name", ...)``/``emit(EventName.X, ...)`` (a name with free fields), no ``{"event": "..."}``
    record made by hand, no ``EventName.X`` that does not exist, no ``record["event"] == "literal"``."""
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "EventName":
                if node.attr not in EventName.__members__:
                    problems.append(f"{where}:{node.lineno}: EventName.{node.attr} is no event")
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first = node.args[0]
                names_one = (isinstance(first, ast.Constant) and first.value in NAMES) or (
                    isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
                    and first.value.id == "EventName")
                if called in ("emit", "write", "append_jsonl", "_emit") and names_one:
                    problems.append(f"{where}:{node.lineno}: {called}() of a name with free fields: use its "
                                    "constructor (orchestrator/events.py) and EventLog.write")
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if _is(key, "event") and isinstance(value, ast.Constant):
                        problems.append(f"{where}:{node.lineno}: a record named by a string: use EventName")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "append_jsonl" and len(node.args) > 1
                    and isinstance(node.args[1], ast.Dict) and any(_is(k, "event") for k in node.args[1].keys)):
                problems.append(f"{where}:{node.lineno}: an event record made by hand: use a constructor")
            if isinstance(node, ast.Compare) and _reads_event(node.left):
                for right in node.comparators:
                    literals = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
                    for lit in literals:
                        if isinstance(lit, ast.Constant) and isinstance(lit.value, str):
                            problems.append(f"{where}:{node.lineno}: compares an event with {lit.value!r}: use "
                                            "EventName or the event's type")
                            if lit.value not in NAMES:
                                problems.append(f"{where}:{node.lineno}: {lit.value!r} is no event")
    assert not problems, "\n".join(problems)


def _is(node, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


def _reads_event(node: ast.AST) -> bool:
    """``x["event"]`` or ``x.get("event")``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"
    return False


def test_the_json_is_what_orch_always_wrote(tmp_path):
    log = EventLog(tmp_path, clock=lambda: 12.5)
    log.write(ev.CheckpointSaved(step=3, stall_s=0.1, write_s=0.2, bytes=10, async_=True, url="file:///c/step_3"))
    log.write(ev.NodeStarted(node=1, pid=7, replacement=False))  # no standby key unless a standby took over
    log.write(ev.RunFinished(status="succeeded", attempts=1, node_exit_codes={"0": 0}))  # no reason unless given
    log.write(ev.LeaseLost(url="u", setting="run.dir", holder=None, by="launcher", reason="r"))  # holder: null
    log.write(ev.LaunchStarted(preset="p", run_id="r", launcher="ray", nodes=2, rendezvous_endpoint="h:1",
                               site={"ray": "auto", "placement": "spread"}))
    log.write(ev.ChaosPartition(node=2, host="ci-2", source="testcluster"), t=3.0)  # the fault's own time
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"t": 12.5, "event": "checkpoint_saved", "step": 3, "stall_s": 0.1, "write_s": 0.2, "bytes": 10,
         "async": True, "url": "file:///c/step_3"},
        {"t": 12.5, "event": "node_started", "node": 1, "pid": 7, "replacement": False},
        {"t": 12.5, "event": "run_finished", "status": "succeeded", "attempts": 1, "node_exit_codes": {"0": 0}},
        {"t": 12.5, "event": "lease_lost", "url": "u", "setting": "run.dir", "holder": None, "by": "launcher",
         "reason": "r"},
        {"t": 12.5, "event": "launch_started", "preset": "p", "run_id": "r", "launcher": "ray", "nodes": 2,
         "rendezvous_endpoint": "h:1", "ray": "auto", "placement": "spread"},
        {"t": 3.0, "event": "chaos_partition", "node": 2, "host": "ci-2", "source": "testcluster"},
    ]
    assert read_jsonl(tmp_path / "events.jsonl")[0]["async"] is True


def test_records_read_back_typed_leniently_and_hand_over_strictly():
    started = {"t": 1.0, "event": "worker_started", "world_size": 2, "restart_count": 0, "step": 0, "ready_t": 5.0}
    assert ev.parse(started) == ev.WorkerStarted(world_size=2, restart_count=0, step=0, milestones={"ready_t": 5.0})
    # a hand-written or older record: what it lacks reads as None; an unknown event is no event
    assert ev.parse({"t": 1.0, "event": "worker_failed", "rank": 1, "error": "E: x"}) == ev.WorkerFailed(
        rank=1, node=None, restart_count=None, error="E: x", traceback=None)
    assert ev.parse({"t": 1.0, "event": "no_such_event"}) is None and ev.parse({"t": 1.0}) is None
    saved = ev.CheckpointSaved(step=1, stall_s=0.0, write_s=0.1, bytes=3, async_=False, url="u")
    assert ev.event_of(saved.event, saved.fields()) == saved
    with pytest.raises(ValueError, match="not an event"):
        ev.event_of("no_such_event", {})
    with pytest.raises(TypeError):
        ev.event_of("first_step", {"step": 1, "world_size": 2, "restart_count": 0, "surprise": 1})


def test_an_event_name_has_one_constructor():
    with pytest.raises(TypeError, match="already has a constructor"):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class AnotherNodeLost(ev.Event):
            """A second node_lost."""

            event = EventName.NODE_LOST
