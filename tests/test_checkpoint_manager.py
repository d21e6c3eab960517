"""CheckpointManager on a real local filesystem (and memory://): roundtrip, crash safety, corruption,
retention, failure reporting, preflight and safe loading. No fsspec mocks."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from orchestrator.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointSetupError,
    FileEntry,
    format_checkpoint_detail,
    format_checkpoint_list,
    step_dirname,
)
from orchestrator.checkpoint.manifest import build_manifest, encode_manifest, sha256_hex
from orchestrator.errors import UserError

pytestmark = pytest.mark.timeout(60)


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=g))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, generator=g)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "trainer": {"step": seed, "loss": 0.25 * seed, "name": "run-a", "done": False, "best": None,
                    "shape": (3, 4), "history": [1, 2.5, "x"], "dtype": torch.float32},
        "rng": {"torch": torch.get_rng_state()},
    }


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.device.type == "cpu" and torch.equal(a.cpu(), b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


class Events:
    def __init__(self):
        self.items: list[tuple[str, dict, str]] = []

    def __call__(self, name: str, fields: dict) -> None:
        self.items.append((name, fields, threading.current_thread().name))

    def named(self, name: str) -> list[dict]:
        return [f for n, f, _ in self.items if n == name]


def corrupt_one_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, io.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("async_save", [False, True])
def test_roundtrip_returns_stall_and_emits_saved(tmp_path, async_save):
    events = Events()
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=async_save, on_event=events)
    mgr.preflight()
    state = make_state(7)
    stall = mgr.save(7, state, {"config_fingerprint": "cafe", "world_size": 2})
    mgr.wait()
    assert isinstance(stall, float) and stall > 0

    loaded = mgr.load()
    assert loaded.step == 7 and loaded.metadata == {"config_fingerprint": "cafe", "world_size": 2}
    assert_same(state, loaded.state)

    (saved,) = events.named("checkpoint_saved")
    assert saved["step"] == 7 and saved["async"] is async_save and saved["bytes"] > 0
    assert saved["write_s"] > 0 and saved["url"].endswith("/ck/step_000000007")
    if async_save:
        assert saved["stall_s"] == stall  # the event reports exactly what save() returned
        (thread,) = [t for n, _, t in events.items if n == "checkpoint_saved"]
        assert thread != threading.current_thread().name  # committed from the background writer
    else:
        assert 0 < saved["stall_s"] <= stall


def test_async_save_copies_state_before_returning(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=True)
    weights = torch.ones(1000)
    mgr.save(1, {"model": {"w": weights}}, {})
    weights.add_(41)  # training mutates parameters in place right after save() returns
    mgr.wait()
    assert torch.equal(mgr.load().state["model"]["w"], torch.ones(1000))


def test_reused_staging_buffers_do_not_leak_into_earlier_checkpoints(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=5, async_save=True)
    for step in range(1, 4):
        mgr.save(step, {"model": {"w": torch.full((64,), float(step))}}, {})
    mgr.wait()
    for step in range(1, 4):
        assert torch.equal(mgr.load(step).state["model"]["w"], torch.full((64,), float(step)))


def test_payload_files_load_with_weights_only(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=False)
    state = make_state(3)
    mgr.save(3, state, {})
    for name in state:
        with open(tmp_path / "ck" / step_dirname(3) / f"{name}.pt", "rb") as f:
            assert_same(state[name], torch.load(f, weights_only=True))


_KILLED_WRITER = r"""
import sys, time, torch
from orchestrator.checkpoint import CheckpointManager
from orchestrator.checkpoint import storage

real_write = storage.CheckpointStorage.write_bytes

def write_bytes(self, relpath, data):
    # Hold the process between the last payload and the manifest so the test can SIGKILL it there.
    if relpath.startswith(".step_2.tmp-") and "/manifest.json" in relpath:
        print("PAYLOADS_WRITTEN", flush=True)
        time.sleep(120)
    return real_write(self, relpath, data)

storage.CheckpointStorage.write_bytes = write_bytes
mgr = CheckpointManager(sys.argv[1], async_save=False)
mgr.save(1, {"model": {"w": torch.full((8,), 1.0)}}, {"n": 1})
mgr.save(2, {"model": {"w": torch.full((8,), 2.0)}}, {"n": 2})
print("NOT KILLED", flush=True)
"""


@pytest.mark.slow
def test_writer_killed_before_manifest_leaves_previous_checkpoint_loadable(tmp_path):
    url = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "PAYLOADS_WRITTEN"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    root = tmp_path / "ck"
    # The dead writer left only its temporary directory: never listed, never loaded, no warning.
    (tmp_dir,) = [p for p in root.iterdir() if p.name.startswith(".step_2.tmp-")]
    assert (tmp_dir / "model.pt").exists() and not (tmp_dir / "manifest.json").exists()
    assert not (root / step_dirname(2)).exists()

    events = Events()
    mgr = CheckpointManager(url, async_save=False, on_event=events)
    assert [(i.step, i.valid) for i in mgr.list()] == [(1, True)]
    assert mgr.latest_valid_step() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = mgr.load()
    assert loaded.step == 1 and torch.equal(loaded.state["model"]["w"], torch.full((8,), 1.0))
    assert events.named("checkpoint_skipped") == []
    with pytest.raises(CheckpointError, match="no checkpoint at step 2"):
        mgr.load(2)
    # Retention clears the leftover once a newer checkpoint is committed.
    mgr.save(3, {"model": {"w": torch.full((8,), 3.0)}}, {})
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(1), step_dirname(3)]


def test_corrupt_payload_is_detected_by_checksum_and_skipped(tmp_path):
    events = Events()
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=False, on_event=events)
    mgr.save(1, {"model": {"w": torch.zeros(256)}}, {})
    mgr.save(2, {"model": {"w": torch.ones(256)}}, {})
    corrupt_one_byte(str(tmp_path / "ck" / step_dirname(2) / "model.pt"))

    assert [i.valid for i in mgr.list()] == [True, True]  # same size: only the checksum can tell
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        loaded = mgr.load()
    assert loaded.step == 1 and torch.equal(loaded.state["model"]["w"], torch.zeros(256))
    (skipped,) = events.named("checkpoint_skipped")
    assert skipped["step"] == 2 and "checksum mismatch for model.pt" in skipped["reason"]
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        mgr.load(2)
    assert "bad: checksum mismatch" in format_checkpoint_detail(str(tmp_path / "ck" / step_dirname(2)))


def test_truncated_payload_makes_checkpoint_invalid(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=False)
    mgr.save(1, {"model": {"w": torch.zeros(16)}}, {})
    mgr.save(2, {"model": {"w": torch.ones(16)}}, {})
    path = tmp_path / "ck" / step_dirname(2) / "model.pt"
    path.write_bytes(path.read_bytes()[:-10])
    info = mgr.list()[-1]
    assert not info.valid and "size mismatch" in info.reason
    with pytest.warns(RuntimeWarning, match="size mismatch"):
        assert mgr.load().step == 1


def test_retention_keeps_exactly_keep_last(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=2, async_save=True)
    for step in range(1, 6):
        mgr.save(step, {"model": {"w": torch.full((4,), float(step))}}, {})
    mgr.wait()
    assert [(i.step, i.valid) for i in mgr.list()] == [(4, True), (5, True)]
    assert sorted(os.listdir(tmp_path / "ck")) == [step_dirname(4), step_dirname(5)]


def test_retention_never_deletes_newest_valid_even_with_later_incomplete_dirs(tmp_path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=1, async_save=False)
    mgr.save(1, {"model": {"w": torch.zeros(4)}}, {})
    for step in (0, 9):  # an older and a newer directory without a manifest (crashed writers)
        (root / step_dirname(step)).mkdir()
        (root / step_dirname(step) / "model.pt").write_bytes(b"partial")
    mgr.save(2, {"model": {"w": torch.ones(4)}}, {})
    assert [(i.step, i.valid) for i in mgr.list()] == [(2, True), (9, False)]
    with pytest.warns(RuntimeWarning, match="step_000000009"):
        assert mgr.load().step == 2


def test_background_failure_surfaces_on_next_save_and_wait(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    events = Events()
    mgr = CheckpointManager(str(blocker / "ck"), async_save=True, on_event=events)

    mgr.save(1, {"model": {"w": torch.zeros(4)}}, {})  # returns at once; the write fails in the thread
    with pytest.raises(CheckpointError, match="step 1"):
        mgr.save(2, {"model": {"w": torch.zeros(4)}}, {})
    (failed,) = events.named("checkpoint_failed")
    assert failed["step"] == 1 and failed["async"] is True and failed["error"]
    assert events.named("checkpoint_saved") == []

    mgr.save(3, {"model": {"w": torch.zeros(4)}}, {})
    with pytest.raises(CheckpointError, match="step 3"):
        mgr.wait()
    mgr.wait()  # the failure is reported once, then the manager is usable again

    blocker.unlink()
    mgr.save(4, {"model": {"w": torch.ones(4)}}, {})
    mgr.wait()
    assert mgr.load().step == 4


def test_sync_failure_raises_from_save(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    events = Events()
    mgr = CheckpointManager(str(blocker / "ck"), async_save=False, on_event=events)
    with pytest.raises(CheckpointError, match="step 1"):
        mgr.save(1, {"model": {"w": torch.zeros(4)}}, {})
    assert [f["step"] for f in events.named("checkpoint_failed")] == [1]


def test_preflight_unknown_scheme_is_a_user_error():
    with pytest.raises(CheckpointSetupError) as exc:
        CheckpointManager("foo://x").preflight()
    msg = str(exc.value)
    assert isinstance(exc.value, UserError) and exc.value.exit_code == 2 and "\n" not in msg
    assert "checkpoint URL 'foo://x' has an unknown filesystem scheme 'foo://'. Fix:" in msg


def test_preflight_unwritable_local_path_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    url = str(blocker / "ck")
    with pytest.raises(CheckpointSetupError) as exc:
        CheckpointManager(url).preflight()
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    assert f"checkpoint URL {url!r} is not writable" in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_preflight_read_only_directory_is_a_user_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(CheckpointSetupError, match="not writable"):
            CheckpointManager(str(ro)).preflight()
    finally:
        ro.chmod(0o755)


def test_preflight_missing_package_names_it():
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed")
    with pytest.raises(CheckpointSetupError, match="pip install gcsfs"):
        CheckpointManager("gs://bucket/run").preflight()


def test_preflight_creates_dir_and_leaves_no_probe(tmp_path):
    root = tmp_path / "a" / "b"
    CheckpointManager(f"file://{root}").preflight()
    assert root.is_dir() and os.listdir(root) == []


class _Exploit:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_loading_never_executes_pickled_code(tmp_path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), async_save=False)
    mgr.save(1, {"model": {"w": torch.zeros(4)}}, {})
    # A hand-made checkpoint whose payload would run os.mkdir when unpickled without weights_only.
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"w": _Exploit(str(marker))}, buf)
    data = buf.getvalue()
    stepdir = root / step_dirname(2)
    stepdir.mkdir()
    (stepdir / "model.pt").write_bytes(data)
    manifest = build_manifest(2, {"model.pt": FileEntry(len(data), sha256_hex(data))}, {})
    (stepdir / "manifest.json").write_bytes(encode_manifest(manifest))

    with pytest.raises(CheckpointError, match="weights_only"):
        mgr.load(2)
    with pytest.warns(RuntimeWarning, match="weights_only"):
        assert mgr.load().step == 1
    assert not marker.exists()


def test_save_refuses_state_that_weights_only_cannot_load(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=True)
    with pytest.raises(CheckpointError, match=r"state\['trainer'\]\['obj'\].*weights_only"):
        mgr.save(1, {"trainer": {"obj": _Exploit("x")}}, {})
    with pytest.raises(CheckpointError, match="JSON"):
        mgr.save(1, {"model": {"w": torch.zeros(1)}}, {"bad": object()})
    with pytest.raises(CheckpointError, match="payload name"):
        mgr.save(1, {"../evil": {"w": torch.zeros(1)}}, {})
    assert mgr.list() == []


def test_load_with_nothing_and_unknown_step(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"))
    assert mgr.load() is None and mgr.list() == [] and mgr.latest_valid_step() is None
    with pytest.raises(CheckpointError, match="no checkpoint at step 5 .* Fix: check the URL"):
        mgr.load(5)
    mgr.save(2, {"model": {"w": torch.zeros(1)}})
    mgr.wait()
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 5 .* Fix: load one of the steps there \(2\)"):
        mgr.load(5)


def test_keep_last_must_be_positive():
    with pytest.raises(CheckpointSetupError, match="keep_last=0 must be an integer >= 1. Fix:") as exc:
        CheckpointManager("memory://x", keep_last=0)
    assert exc.value.exit_code == 2 and "checkpoint.keep_last" not in str(exc.value)


def test_launch_preflight_names_the_setting_and_the_manager_does_not():
    """orch launch's preflight names checkpoint.url (where the user set it); the manager, used from any code,
    names the URL only."""
    from orchestrator.checkpoint import preflight_storage

    with pytest.raises(CheckpointSetupError, match=r"^checkpoint.url='foo://x' has an unknown filesystem scheme"):
        preflight_storage("foo://x")
    with pytest.raises(CheckpointSetupError, match=r"^checkpoint URL 'foo://x' has an unknown filesystem scheme"):
        CheckpointManager("foo://x").list()


def test_memory_url_and_inspect_views(tmp_path):
    url = f"memory://orch-test-{os.getpid()}-{id(tmp_path)}/run"
    mgr = CheckpointManager(url, keep_last=3, async_save=False)
    try:
        mgr.preflight()
        mgr.save(12, {"model": {"w": torch.zeros(4)}}, {"config_fingerprint": "f00d", "lr": 0.1})
        listing = format_checkpoint_list(url)
        assert "12" in listing and "yes" in listing and "f00d" in listing
        for target in (url, f"{url}/{step_dirname(12)}", f"{url}/{step_dirname(12)}/"):
            detail = format_checkpoint_detail(target)
            assert f"{url}/step_000000012" in detail and "model.pt" in detail and " ok" in detail
            assert '"config_fingerprint": "f00d"' in detail
        with pytest.raises(UserError, match="step_000000013"):
            format_checkpoint_detail(f"{url}/{step_dirname(13)}")
    finally:
        mgr.storage.fs.rm(mgr.storage.root, recursive=True)


def test_resave_same_step_replaces_it(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ck"), async_save=False)
    mgr.save(1, {"model": {"w": torch.zeros(4)}, "extra": {"x": 1}}, {"v": 1})
    mgr.save(1, {"model": {"w": torch.ones(4)}}, {"v": 2})
    loaded = mgr.load(1)
    assert set(loaded.state) == {"model"} and loaded.metadata == {"v": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(mgr.load().state["model"]["w"], torch.ones(4))


def test_ckpt_bench_smoke(tmp_path):
    from orchestrator.bench.ckpt import main_ckpt_bench

    out = tmp_path / "bench.json"
    result = main_ckpt_bench(str(out), size_mb=1)
    assert set(result) == {"sync_stall_s", "async_stall_s", "ratio", "state_mb", "dcp_sync_stall_s",
                           "dcp_async_stall_s", "dcp_async_over_dcp_sync", "dcp_async_over_rank0_async",
                           "dcp_sync_over_rank0_sync"}
    assert 0.5 < result["state_mb"] < 2 and result["sync_stall_s"] > 0 and result["async_stall_s"] > 0
    assert result["dcp_sync_stall_s"] > 0 and result["dcp_async_stall_s"] > 0
    assert out.read_text().startswith("{")


# -- URL rules ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, problem", [
    ("s3://", "has no bucket or path after 's3://'"),
    ("gs://", "has no bucket or path after 'gs://'"),
    ("memory://", "has no bucket or path after 'memory://'"),
    ("file://", "has no path after 'file://'"),
    ("file:///", "names the filesystem root"),
    ("", "is empty"),
    ("   ", "is empty"),
    ("file:///ABS/ck/", None),  # maps to the absolute path (ABS is replaced by tmp_path)
    ("memory-multi-rank", "is an in-process memory filesystem"),
])
def test_checkpoint_url_rules(tmp_path, monkeypatch, url, problem):
    monkeypatch.chdir(tmp_path)  # anything written relative to the cwd would show up here
    if url == "memory-multi-rank":
        from orchestrator.config.compose import compose_config
        from orchestrator.errors import ConfigError

        with pytest.raises(ConfigError, match=rf"^checkpoint.url='memory://ck' {problem}.*Fix: ") as exc:
            compose_config("cpu_gloo", ["checkpoint.url=memory://ck", "cluster.nnodes=2"])
        assert exc.value.exit_code == 2
        compose_config("cpu_gloo", ["checkpoint.url=memory://ck", "cluster.nnodes=1", "cluster.nproc_per_node=1"])
        return
    from orchestrator.checkpoint import preflight_storage

    if problem is None:
        target = tmp_path / "abs"
        url = url.replace("/ABS", str(target))
        preflight_storage(url)
        mgr = CheckpointManager(url, async_save=False)
        mgr.save(1, {"model": {"w": torch.ones(2)}}, {})
        assert (target / "ck" / step_dirname(1) / "manifest.json").exists()
        assert mgr.list()[0].url == f"file://{target}/ck/{step_dirname(1)}"
        assert sorted(os.listdir(tmp_path)) == ["abs"]
        return
    with pytest.raises(CheckpointSetupError, match=rf"^checkpoint.url={url!r} {problem}\. Fix: \S") as exc:
        preflight_storage(url)
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    with pytest.raises(CheckpointSetupError, match=rf"^checkpoint URL {url!r} {problem}"):
        CheckpointManager(url).list()
    assert os.listdir(tmp_path) == []  # no "s3:" or "file:" folder appeared in the cwd


# -- commit protocol ----------------------------------------------------------------------------------------
def _fail_after_first_payload(monkeypatch, error: Exception) -> None:
    real = CheckpointManager._write_payload
    calls = []

    def write_payload(self, storage, relpath, data):
        if calls:
            raise error
        calls.append(relpath)
        real(self, storage, relpath, data)

    monkeypatch.setattr(CheckpointManager, "_write_payload", write_payload)


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_resave_keeps_the_committed_step_and_leaves_no_partial_files(tmp_path, monkeypatch, async_save):
    root = tmp_path / "ck"
    events = Events()
    mgr = CheckpointManager(str(root), async_save=async_save, on_event=events)
    mgr.save(1, {"model": {"w": torch.zeros(8)}}, {"v": 1})
    mgr.save(2, {"model": {"w": torch.full((8,), 2.0)}, "optim": {"lr": 0.1}}, {"v": 2})
    mgr.wait()
    before = sorted(os.listdir(root))

    _fail_after_first_payload(monkeypatch, OSError(28, "No space left on device"))
    with pytest.raises(CheckpointError, match="step 2.*No space left"):
        mgr.save(2, {"model": {"w": torch.full((8,), 9.0)}, "optim": {"lr": 0.9}}, {"v": 3})
        mgr.wait()
    (failed,) = events.named("checkpoint_failed")
    assert failed["step"] == 2 and "No space left" in failed["error"]
    assert sorted(os.listdir(root)) == before  # no .step_2.tmp-* left behind
    loaded = mgr.load(2)
    assert loaded.metadata == {"v": 2} and torch.equal(loaded.state["model"]["w"], torch.full((8,), 2.0))
    assert [(i.step, i.valid) for i in mgr.list()] == [(1, True), (2, True)]

    monkeypatch.undo()
    mgr.save(2, {"model": {"w": torch.full((8,), 9.0)}}, {"v": 3})  # a later re-save swaps it in
    mgr.wait()
    assert mgr.load(2).metadata == {"v": 3} and sorted(os.listdir(root)) == before


def test_temporary_names_are_never_listed_or_loaded(tmp_path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), async_save=False)
    mgr.save(1, {"model": {"w": torch.zeros(4)}}, {})
    # A complete-looking checkpoint under each temporary name: still never a checkpoint.
    for name in (".step_5.tmp-0123abcd", ".step_6.old-4567ef00"):
        (root / name).mkdir()
        for f in os.listdir(root / step_dirname(1)):
            (root / name / f).write_bytes((root / step_dirname(1) / f).read_bytes())
    assert [i.step for i in mgr.list()] == [1]
    assert "step_000000005" not in format_checkpoint_list(str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.load().step == 1
    with pytest.raises(CheckpointError, match="no checkpoint at step 5"):
        mgr.load(5)


def test_swap_interrupted_between_renames_is_restored(tmp_path):
    """A writer killed after renaming the old step aside and before renaming the new one in leaves
    ``.step_N.old-*``; the next save puts it back, so the step is never lost."""
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), async_save=False)
    mgr.save(3, {"model": {"w": torch.ones(4)}}, {"v": 3})
    os.rename(root / step_dirname(3), root / ".step_3.old-deadbeef")
    mgr.save(4, {"model": {"w": torch.zeros(4)}}, {"v": 4})
    assert [(i.step, i.valid) for i in mgr.list()] == [(3, True), (4, True)]
    assert mgr.load(3).metadata == {"v": 3}


def test_save_refused_when_free_space_is_below_the_previous_checkpoint(tmp_path, monkeypatch):
    from orchestrator.checkpoint.storage import CheckpointStorage

    root = tmp_path / "ck"
    events = Events()
    mgr = CheckpointManager(str(root), async_save=False, on_event=events)
    mgr.save(1, {"model": {"w": torch.zeros(64)}}, {})
    monkeypatch.setattr(CheckpointStorage, "free_bytes", lambda self: 10)
    with pytest.raises(CheckpointError, match=r"refused: not enough free space .* 10 bytes free.* Fix: "):
        mgr.save(2, {"model": {"w": torch.ones(64)}}, {})
    (failed,) = events.named("checkpoint_failed")
    assert failed["step"] == 2 and "not enough free space" in failed["error"]
    assert sorted(os.listdir(root)) == [step_dirname(1)] and mgr.load().step == 1


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 2 MiB tmpfs, mounted by the mount(2) system call itself (no mount process to start)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if libc.mount(b"tmpfs", os.fsencode(mnt), b"tmpfs", 0, b"size=2m") != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here: {os.strerror(ctypes.get_errno())}")
    try:
        yield mnt
    finally:
        libc.umount2(os.fsencode(mnt), 0)


def test_resave_on_a_full_disk_keeps_the_previous_checkpoint(tiny_tmpfs):
    """A real ENOSPC midway through a re-save of the same step (2 MiB tmpfs) leaves the committed one."""
    url = str(tiny_tmpfs / "ck")
    events = Events()
    mgr = CheckpointManager(url, async_save=False, on_event=events)
    mgr.save(1, {"model": {"w": torch.zeros(100_000)}}, {"v": 1})  # ~400 KB; ~1.6 MB stays free
    with pytest.raises(CheckpointError, match="step 1"):  # ~2.4 MB: passes the size check, then fills the disk
        mgr.save(1, {"model": {"w": torch.ones(300_000)}, "optim": {"m": torch.ones(300_000)}}, {"v": 2})
    (failed,) = events.named("checkpoint_failed")
    assert "No space left" in failed["error"] or "Errno 28" in failed["error"]
    assert os.listdir(url) == [step_dirname(1)]
    loaded = mgr.load(1)
    assert loaded.metadata == {"v": 1} and torch.equal(loaded.state["model"]["w"], torch.zeros(100_000))
