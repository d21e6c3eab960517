"""``orch ckpt list`` as a user calls it (issue 27): a run dir or a checkpoint URL, orch's checkpoints and HF
Trainer's ``checkpoint-N`` folders in one table, each with the reason it was saved. Checkpoints are written in
process by CheckpointManager; the CLI runs in process."""

from __future__ import annotations

import json
import re

import pytest
import torch

from orchestrator.checkpoint import CheckpointManager
from orchestrator.checkpoint.hf_dirs import COMPLETE_MARKER
from orchestrator.events import EmergencyCheckpoint, LaunchStarted, StopRequested
from orchestrator.rundir import CONFIG_FILE, EventLog
from orchproc import orch_here

pytestmark = pytest.mark.timeout(60)

COLUMNS = ["step", "valid", "reason", "size", "created", "config_fingerprint", "engine", "world_size"]


def rows_of(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table's rows by (engine, step): the header is the line starting with ``step``; cells are two or
    more spaces apart (a cell holds single spaces at most)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert re.split(r"\s{2,}", lines[start]) == COLUMNS, lines[start]
    rows = {}
    for line in lines[start + 1:]:
        if not line or not line[0].isdigit():
            break
        cells = dict(zip(COLUMNS, re.split(r"\s{2,}", line)))
        rows[(cells["engine"], cells["step"])] = cells
    return rows


def save(url: str, step: int, reason: str, world_size: int = 2) -> None:
    CheckpointManager(url, keep_last=10, async_save=False).save(
        step, {"model": {"w": torch.full((4,), float(step))}}, {"reason": reason, "world_size": world_size})


def hf_checkpoint(hf_dir, step: int, marker: dict | None) -> None:
    folder = hf_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 2048)
    if marker is not None:
        (folder / COMPLETE_MARKER).write_text(json.dumps(marker))


def make_run(tmp_path):
    """A run dir as orch leaves it: config.yaml (no checkpoint.url: <run dir>/checkpoints), orch's checkpoints
    of every reason (step 6: the emergency save of an `orch stop`; step 9: of a real preemption, after the
    resume's launch) and HF's checkpoint-4 (complete) and checkpoint-8 (cut short)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_FILE).write_text("checkpoint:\n  url: null\n")
    url = str(run / "checkpoints")
    events = EventLog(run)
    launch = LaunchStarted(preset="cpu_gloo", run_id="r1", launcher="local", nodes=2, rendezvous_endpoint=None)
    events.write(launch)
    save(url, 3, "periodic")
    events.write(StopRequested(grace_period_s=30.0))
    save(url, 6, "preemption")
    events.write(EmergencyCheckpoint(step=6, save_s=0.1, since_notice_s=0.2))
    events.write(launch)
    save(url, 9, "preemption", world_size=1)
    events.write(EmergencyCheckpoint(step=9, save_s=0.1, since_notice_s=0.2))
    save(url, 10, "final", world_size=1)
    hf_checkpoint(run / "checkpoints" / "hf", 4, {"step": 4, "world_size": 3, "reason": "periodic", "t": 1.8e9})
    hf_checkpoint(run / "checkpoints" / "hf", 8, None)
    return run


def test_list_of_a_run_dir_shows_every_checkpoint_and_why_it_was_saved(tmp_path, capsys):
    run = make_run(tmp_path)
    result = orch_here(capsys, "ckpt", "list", str(run))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"checkpoints under {run / 'checkpoints'} (the checkpoint URL of run dir {run})")
    rows = rows_of(result.stdout)
    assert {k: (r["valid"], r["reason"], r["world_size"]) for k, r in rows.items()} == {
        ("rank0", "3"): ("yes", "periodic", "2"),
        ("rank0", "6"): ("yes", "stop", "2"),
        ("rank0", "9"): ("yes", "preemption", "1"),
        ("rank0", "10"): ("yes", "final", "1"),
        ("hf", "4"): ("yes", "periodic", "3"),
        ("hf", "8"): ("no: not marked complete", "-", "-"),
    }
    assert rows[("hf", "4")]["size"] == "2.1 KB"  # the folder's files, the marker's 70 bytes among them
    assert rows[("hf", "4")]["created"] == "2027-01-15 08:00:00Z"
    assert f"engine hf: transformers.Trainer's checkpoint-N under {run / 'checkpoints' / 'hf'}" in result.stdout


def test_list_of_a_url_or_hf_output_dir(tmp_path, capsys):
    """The checkpoint URL as before (no run dir, so no events: a stop's save reads preemption), and HF's
    output_dir alone lists only HF's checkpoints."""
    run = make_run(tmp_path)
    rows = rows_of(orch_here(capsys, "ckpt", "list", str(run / "checkpoints")).stdout)
    assert rows[("rank0", "6")]["reason"] == "preemption" and ("hf", "4") in rows
    rows = rows_of(orch_here(capsys, "ckpt", "list", str(run / "checkpoints" / "hf")).stdout)
    assert set(rows) == {("hf", "4"), ("hf", "8")}


def test_run_dir_with_its_own_checkpoint_url(tmp_path, capsys):
    run, elsewhere = tmp_path / "run", tmp_path / "store"
    run.mkdir()
    (run / CONFIG_FILE).write_text(f"checkpoint:\n  url: {elsewhere}\n")
    result = orch_here(capsys, "ckpt", "list", str(run))
    assert result.returncode == 0
    assert result.stdout.strip() == f"no checkpoints under {elsewhere} (the checkpoint URL of run dir {run})"
    save(str(elsewhere), 5, "periodic")
    assert rows_of(orch_here(capsys, "ckpt", "list", str(run)).stdout)[("rank0", "5")]["reason"] == "periodic"
    inspected = orch_here(capsys, "ckpt", "inspect", str(run))
    assert inspected.returncode == 0 and f"checkpoint {elsewhere}/step_000000005" in inspected.stdout
