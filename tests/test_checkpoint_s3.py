"""CheckpointManager against a real S3 API (moto's server on loopback) through s3fs.

The manager sees only plain ``s3://bucket/prefix`` URLs; the endpoint and credentials come from the
standard AWS environment variables that botocore reads (``AWS_ENDPOINT_URL`` ...), set by ``s3_env``.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointSetupError,
    format_checkpoint_detail,
    format_checkpoint_list,
    step_dirname,
)

pytestmark = pytest.mark.timeout(60)
s3fs = pytest.importorskip("s3fs")


def state(step: int) -> dict:
    return {"model": {"w": torch.full((32,), float(step)), "b": torch.arange(step + 1)},
            "trainer": {"step": step, "tag": ("s3", None, True)}}


class Events(list):
    def __call__(self, name, fields):
        self.append((name, fields))


def test_s3_save_load_retention(s3_bucket):
    url = f"s3://{s3_bucket}/runs/a"
    events = Events()
    mgr = CheckpointManager(url, keep_last=2, async_save=True, on_event=events)
    mgr.preflight()
    for step in range(1, 5):
        assert mgr.save(step, state(step), {"config_fingerprint": "abc"}) > 0
    mgr.wait()

    assert [(i.step, i.valid) for i in mgr.list()] == [(3, True), (4, True)]
    assert mgr.list()[-1].url == f"{url}/step_000000004"
    loaded = mgr.load()
    assert loaded.step == 4 and loaded.metadata == {"config_fingerprint": "abc"}
    assert torch.equal(loaded.state["model"]["w"], torch.full((32,), 4.0))
    assert loaded.state["trainer"] == {"step": 4, "tag": ("s3", None, True)}
    assert [f["step"] for n, f in events if n == "checkpoint_saved"] == [1, 2, 3, 4]
    assert all(f["url"].startswith(f"s3://{s3_bucket}/runs/a/step_") for n, f in events)

    fs = s3fs.S3FileSystem()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_bucket}/runs/a", refresh=True)) == [
        step_dirname(3), step_dirname(4)]
    assert "abc" in format_checkpoint_list(url)
    detail = format_checkpoint_detail(f"{url}/step_000000003")
    assert detail.startswith(f"checkpoint {url}/step_000000003\n")  # the s3:// double slash survives
    files = [line for line in detail.splitlines() if line.startswith(("model.pt ", "trainer.pt "))]
    assert len(files) == 2 and all(line.endswith(" ok") for line in files), detail  # (the bucket's random name
    # may hold any word: only the files' check column counts)


def test_s3_corrupt_and_incomplete_checkpoints_are_skipped(s3_bucket):
    url = f"s3://{s3_bucket}/run"
    events = Events()
    mgr = CheckpointManager(url, keep_last=5, async_save=False, on_event=events)
    for step in (1, 2, 3):
        mgr.save(step, state(step), {})
    fs = s3fs.S3FileSystem()
    # Step 3: one payload byte flipped in place (same size, so only the checksum can tell).
    key = f"{s3_bucket}/run/{step_dirname(3)}/model.pt"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    # Step 4: payloads written, manifest never (a writer that died before committing).
    fs.pipe_file(f"{s3_bucket}/run/{step_dirname(4)}/model.pt", b"partial")

    with pytest.warns(RuntimeWarning) as record:
        loaded = mgr.load()
    assert loaded.step == 2 and torch.equal(loaded.state["model"]["w"], torch.full((32,), 2.0))
    messages = [str(w.message) for w in record]
    assert any("step_000000004" in m and "manifest" in m for m in messages)
    assert any("step_000000003" in m and "checksum mismatch" in m for m in messages)
    assert [f["step"] for n, f in events if n == "checkpoint_skipped"] == [4, 3]
    with pytest.raises(CheckpointError, match="checksum"):
        mgr.load(3)


def test_s3_preflight_missing_bucket_is_a_user_error_and_creates_nothing(s3_env):
    url = "s3://orch-no-such-bucket/run"
    with pytest.raises(CheckpointSetupError) as exc:
        CheckpointManager(url).preflight()
    msg = str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in msg
    assert f"checkpoint URL {url!r} names a bucket that does not exist" in msg
    assert "Fix: create the bucket 'orch-no-such-bucket'" in msg
    assert not s3fs.S3FileSystem().exists("orch-no-such-bucket")


def test_s3_preflight_without_credentials_is_a_user_error(s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(CheckpointSetupError) as exc:
        CheckpointManager(f"s3://{s3_bucket}/run").preflight()
    msg = str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in msg
    assert f"checkpoint URL 's3://{s3_bucket}/run'" in msg and "credentials" in msg and "AWS_ACCESS_KEY_ID" in msg


def test_s3_preflight_ok_leaves_no_probe(s3_bucket):
    CheckpointManager(f"s3://{s3_bucket}/run").preflight()
    assert s3fs.S3FileSystem().find(s3_bucket, refresh=True) == []


def test_s3_preflight_with_invalid_credentials_is_a_user_error(s3_bucket, monkeypatch):
    from moto import settings as moto_settings

    # The moto server runs in this process: make it check credentials, which "testing" then fails.
    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(CheckpointSetupError) as exc:
        CheckpointManager(f"s3://{s3_bucket}/run").preflight()
    assert exc.value.exit_code == 2 and "credentials" in str(exc.value)
