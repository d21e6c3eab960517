"""A DCP checkpoint is read without trusting it: its ``.metadata`` is a pickle that torch's own reader would
``pickle.load``, so whoever can write to the checkpoint URL could run code in every rank that resumes. Here an
attacker who can write the whole step directory (the manifest too, so every checksum matches) replaces the
index with one that runs a command when unpickled, or with a genuine DCP index whose items are pickled objects:
the load refuses it in one line and nothing runs."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from orchestrator.checkpoint import step_dirname
from orchestrator.checkpoint.dcp_metadata import UnsafeCheckpoint, parse_metadata
from orchestrator.checkpoint.inspect import inspect_checkpoint
from orchestrator.config.schema import CheckpointConfig
from orchestrator.elastic.checkpoints import SessionCheckpoints
from orchestrator.errors import CheckpointError
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Progress, TrainingState

pytestmark = pytest.mark.timeout(120)


class _RunsCode:
    """Unpickling this runs ``os.system(command)``: what a stranger's ``.metadata`` could hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _session(url: str, resume: str = "auto") -> SessionCheckpoints:
    model = torch.nn.Linear(4, 2)
    state = TrainingState(Progress())
    state.register({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})
    return SessionCheckpoints(CheckpointConfig(async_save=False, resume=resume), url, state,
                              DistContext(0, 1, 0, 1, 0, 0), torch.device("cpu"), 0, lambda e: None, engine="dcp")


def _forge(url: str, step: int, metadata: bytes) -> None:
    """Replace step's ``.metadata`` and list it in the manifest with its true size and sha256."""
    stepdir = f"{url}/{step_dirname(step)}"
    with open(f"{stepdir}/.metadata", "wb") as f:
        f.write(metadata)
    manifest = json.load(open(f"{stepdir}/manifest.json"))
    manifest["files"][".metadata"] = {"size": len(metadata), "sha256": hashlib.sha256(metadata).hexdigest()}
    with open(f"{stepdir}/manifest.json", "w") as f:
        json.dump(manifest, f)


def _bytes_index(tmp_path) -> bytes:
    """A genuine DCP index whose item is a pickled object (DCP reads those with weights_only=False)."""
    out = tmp_path / "bytes_item"
    with pytest.warns(UserWarning):
        dcp.save({"model.weight": torch.ones(2), "model.extra": {"any": "object"}}, checkpoint_id=str(out),
                 no_dist=True)
    return (out / ".metadata").read_bytes()


@pytest.mark.parametrize("forged", ["runs_code", "bytes_item"])
def test_a_forged_index_is_refused_in_one_line_and_runs_nothing(tmp_path, forged):
    url, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _session(url).finish()
    payload = (pickle.dumps(_RunsCode(f"touch {marker}")) if forged == "runs_code" else _bytes_index(tmp_path))
    _forge(url, 0, payload)

    with pytest.raises(CheckpointError) as refused:
        _session(url, resume="0").restore()
    message = str(refused.value)
    assert "\n" not in message and ("refused" in message or "non-tensor" in message), message
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        assert _session(url).restore() is None  # auto: skipped like a corrupt one, nothing loaded
    text, problem = inspect_checkpoint(url)
    assert problem is not None and "valid: no" in text
    assert not marker.exists()


def test_the_index_must_match_its_manifest(tmp_path):
    url = str(tmp_path / "ckpt")
    _session(url).finish()
    data = open(f"{url}/{step_dirname(0)}/.metadata", "rb").read()
    assert parse_metadata(data).state_dict_metadata  # the genuine one reads
    with pytest.raises(UnsafeCheckpoint, match="sha256"):
        parse_metadata(data, expected_sha256="0" * 64)
