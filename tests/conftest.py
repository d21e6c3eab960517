"""Shared pytest fixtures."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

pytest_plugins = ["orch_testcluster"]  # the testcluster fixture (opt-in: not loaded into users' pytest sessions)


@pytest.fixture(autouse=True)
def run_index_in_tmp(tmp_path_factory, monkeypatch):
    """Every launch registers its run in the user's index of runs ($XDG_STATE_HOME/orch): a test's go to a
    temporary state dir of the test's own (orch processes the test starts inherit it), never the developer's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def cache_in_tmp(session_cache_dir, monkeypatch):
    """orch's user cache (targets already checked: orchestrator/config/checked_targets.py) is the test
    session's own, shared by its tests and the orch processes they start, never the developer's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(session_cache_dir))


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 API: moto's server on loopback, on a port the OS picked. Yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto_server, monkeypatch, tmp_path):
    """Point botocore (hence s3fs) at the moto server through standard AWS environment variables only, so
    code under test uses plain ``s3://bucket/prefix`` URLs. Yields the endpoint URL."""
    s3fs = pytest.importorskip("s3fs")
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Never read the developer's real ~/.aws files or probe a cloud metadata service from a test.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.fspath(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", os.fspath(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # fsspec caches filesystem instances (and their credentials) across tests: start each test fresh.
    s3fs.S3FileSystem.clear_instance_cache()
    yield moto_server
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_bucket(s3_env):
    """A fresh, empty bucket on the moto server; yields its name."""
    import s3fs

    name = f"orch-test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    yield name


@pytest.fixture
def outside_torchrun(monkeypatch):
    """A plain process: no torchrun or orch variables, and the SIGTERM handler a session's watcher installs is
    put back afterwards."""
    for var in ("ORCH_RUN_DIR", "ORCH_NODE", "ORCH_SIGTERM_NOTICE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(var, raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
