"""``k8s.run_secret``: the Kubernetes store gated with the run's secret, as under ``orch launch``. Rendering puts
a Secret reference (never a value) into the store's and the nodes' containers of every format that runs orch's
store; ``orch rendezvous-store`` with ``ORCH_RUN_SECRET`` refuses clients that cannot prove it and serves orch's
tunnel; a pod's launcher (``rendezvous.external``) then starts its agents through the tunnel."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from k8s_validation import assert_render_refused, pod_templates, validate_all
from orchestrator.k8s import render
from orchestrator.rendezvous.agent import store_client
from orchestrator.trust.handshake import MAGIC, NONCE_BYTES
from orchestrator.trust.secret import RUN_SECRET_ENV
from orchproc import ORCH, orch_env, wait_for

OWN_STORE = ["job", "jobset", "trainjob", "pytorchjob"]  # formats whose pods dial `orch rendezvous-store`
SENTINEL = "d0-not-render-me-" + "7f" * 16  # the driver's own secret: must never reach a manifest
LISTENING = re.compile(r"rendezvous store listening on \S+ port (\d+)")

# A client without the secret, in a process of its own (a hung torch client cannot hold up the test).
PLAIN_CLIENT = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
try:
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=3))
    store.set("k", "v")
    print("WROTE", store.get("k").decode())
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


def rendered(fmt: str, *extra: str):
    return render("cpu_gloo", ["checkpoint.url=s3://b/c", "run.id=g1", *extra], fmt)


def orch_containers(objs: list[dict]) -> list[dict]:
    """Every container of every pod template (each runs orch: the store or a node)."""
    return [c for o in objs for t in pod_templates(o) for c in t["spec"]["containers"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", OWN_STORE)
@pytest.mark.parametrize("ref, name, key", [("rdzv", "rdzv", "secret"), ("rdzv/token", "rdzv", "token")])
def test_run_secret_reaches_the_store_and_every_node_as_a_reference_only(monkeypatch, fmt, ref, name, key):
    monkeypatch.setenv(RUN_SECRET_ENV, SENTINEL)
    result = rendered(fmt, f"k8s.run_secret={ref}")
    validate_all(result.objects)
    containers = orch_containers(result.objects)
    assert {c["name"] for c in containers} >= {"store"} and len(containers) >= 2
    for c in containers:
        (env,) = [e for e in c["env"] if e["name"] == RUN_SECRET_ENV]
        assert env == {"name": RUN_SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}, c["name"]
    text = result.text()
    assert SENTINEL not in text and text.count(f"name: {RUN_SECRET_ENV}") == len(containers)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", OWN_STORE)
def test_with_run_secret_empty_no_container_gets_one_and_the_render_warns(fmt):
    """``k8s.run_secret=''`` is the explicit opt-out; the default gates the store with a Secret named after the
    job (tests/security/test_k8s_hardening.py)."""
    result = rendered(fmt, "k8s.run_secret=''")
    assert RUN_SECRET_ENV not in result.text()
    (store,) = [c for c in orch_containers(result.objects) if c["name"] == "store"]
    assert "env" not in store  # the store's container as before the gate
    assert any(w.startswith("k8s.run_secret='': the rendezvous store is not gated") for w in result.warnings)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, words", [
    (["k8s.run_secret=Bad_Name!"], ["k8s.run_secret=Bad_Name!"]),  # Hydra's own parse error names it
    (["k8s.run_secret='Bad_Name!'"], ["k8s.run_secret='Bad_Name!' is invalid", "Fix: name a Secret", "NAME/KEY"]),
    (["k8s.run_secret=Bad_Name"], ["k8s.run_secret='Bad_Name' is invalid", "Fix:"]),
    (["k8s.run_secret=rdzv/a/b"], ["k8s.run_secret='rdzv/a/b' is invalid", "Fix:"]),
    (["k8s.run_secret=rdzv", "--format", "rayjob"], ["k8s.run_secret='rdzv' has no store to gate in --format rayjob",
                                                     "Fix: drop k8s.run_secret"]),
])
def test_a_bad_run_secret_exits_2_with_one_line(tmp_path, capsys, args, words):
    assert_render_refused(tmp_path, capsys, ["conf=cpu_gloo", "checkpoint.url=s3://b/c", *args], words)


def start_store(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, int]:
    """``orch rendezvous-store`` on a free loopback port; returns the process and the port it printed."""
    proc = subprocess.Popen([*ORCH, "rendezvous-store", "--port", "0", "--host", "127.0.0.1"], env=orch_env(env),
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    match = wait_for(lambda: LISTENING.search(log.read_text()) or (proc.poll() is not None and log.read_text() + " "),
                     45, "the store to listen")
    assert isinstance(match, re.Match), match
    return proc, int(match.group(1))


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def plain_client(port: int) -> str:
    return subprocess.run([sys.executable, "-c", PLAIN_CLIENT, str(port)], capture_output=True, text=True,
                          timeout=40).stdout.strip()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_gated_store_process_refuses_a_plain_client_and_serves_a_relay(tmp_path):
    secret, log = "s3cr3t-" + "ab" * 16, tmp_path / "store.log"
    env = {k: v for k, v in os.environ.items() if k != RUN_SECRET_ENV}
    proc, port = start_store({**env, RUN_SECRET_ENV: secret}, log)
    try:
        assert plain_client(port).startswith("REFUSED")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # a wrong answer: cut off
            assert len(raw.recv(len(MAGIC) + NONCE_BYTES)) == len(MAGIC) + NONCE_BYTES
            raw.sendall(b"\0" * NONCE_BYTES + b"\0\x09store/run")
            raw.recv(32)  # the server's proof
            raw.sendall(b"\0" * 32)
            raw.settimeout(10)
            try:
                assert raw.recv(1) == b""
            except ConnectionResetError:
                pass
        client, relay = store_client(("127.0.0.1", port), secret, timeout_s=10)
        try:
            client.set("member", "was here")
            assert client.get("member") == b"was here"
        finally:
            relay.close()
        text = log.read_text()
        assert "gated" in text and secret not in text
    finally:
        stop(proc)
    assert secret not in log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_store_process_without_the_secret_accepts_a_plain_client(tmp_path):
    log = tmp_path / "store.log"
    proc, port = start_store({k: v for k, v in os.environ.items() if k != RUN_SECRET_ENV}, log)
    try:
        assert plain_client(port) == "WROTE v"
        assert "gated" not in log.read_text()
    finally:
        stop(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret, gated", [("s3cr3t", True), (None, False)])
def test_a_pods_launcher_relays_to_the_external_store_only_with_the_secret(monkeypatch, tmp_path, secret, gated):
    from launchers import runner
    from orchestrator.config.compose import compose_config
    from orchestrator.site import make_site

    seen: dict = {}

    class Recorder:
        def __init__(self, cfg, plan, pool, events, agents, **kwargs):
            seen.update(agents=agents, **kwargs)

    class NoLeases:  # a pod of node 1 waits for node 0's lease, which this test has no node 0 to take
        def release(self):
            pass

    monkeypatch.setattr(runner, "Controller", Recorder)
    monkeypatch.setattr(runner, "run_with_signals", lambda controller, *_: "succeeded")
    monkeypatch.setattr(runner, "check", lambda cfg, site: None)
    monkeypatch.setattr(runner, "open_run_dir", lambda *args: NoLeases())
    if secret:
        monkeypatch.setenv(RUN_SECRET_ENV, secret)
    else:
        monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    cfg = compose_config("cpu_gloo", ["launcher=local", "rendezvous.external=true", "rendezvous.host=orch-g1-rdzv",
                                      "rendezvous.port=29400", "cluster.node_index=1", "run.id=g1", f"run.dir={tmp_path}"])
    site = make_site(cfg, "g1")
    assert site.store_host() is None and site.node_indexes == [1], "a pod hosts no store and plays its own node"
    assert site.run(cfg, "g1", None, None) == "succeeded"
    assert seen["agents"].gated is gated and seen["nodes"] == [1]
    assert seen["agents"].secret_env == ({RUN_SECRET_ENV: secret} if secret else {})
