"""Attacks on the run's store and its gate, each against the real thing (orch's store behind its gate, torch's
own TCPStore client, orch's agent-side relays and rendezvous backend): a client without the secret writes
nothing, a forged rendezvous state is never unpickled, a fake server learns nothing, a stranger on the same
host cannot use an agent's relay. One store in this process; the attacks whose attacker is a process of its own
(torch's client, an agent's process tree) are slow."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from orchestrator.rendezvous import RendezvousStore
from orchestrator.rendezvous import state as rs
from orchestrator.rendezvous.agent import store_client
from orchestrator.rendezvous.backend import SealedBackend
from orchestrator.rendezvous.kvstore import KEY_PREFIX
from orchestrator.trust import handshake
from orchestrator.trust.relay import LocalRelay
from security.attackers import stranger_writes, touching_state

pytestmark = pytest.mark.timeout(120)

SECRET = "the-runs-secret"
RUN = "job"


@pytest.fixture
def store():
    refused, forged = [], []
    store = RendezvousStore("127.0.0.1", 0, secret=SECRET, on_refused=lambda p, why: refused.append((p, why)),
                            on_value_refused=lambda key, peer: forged.append((key, peer)))
    store.refused_log, store.forged_log = refused, forged
    yield store
    store.close()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.slow
def test_torchs_client_without_the_secret_writes_nothing_and_is_recorded(store, tmp_path):
    marker = tmp_path / "MARKER"
    verdict = stranger_writes("127.0.0.1", store.port, rs.state_key(RUN), touching_state(marker))
    assert verdict.startswith("REFUSED"), verdict
    assert store.kv.keys() == [] and not marker.exists()
    assert wait_until(lambda: store.refused_log), "the refusal was reported"
    peer, why = store.refused_log[0]
    assert peer.startswith("127.0.0.1:") and why, store.refused_log


def test_a_wrong_secret_a_replayed_handshake_and_garbage_are_refused(store):
    with pytest.raises(handshake.HandshakeError, match="could not prove"):
        handshake.connect(("127.0.0.1", store.port), "a guess", "store/run")

    # A recorded good handshake, replayed: the server's fresh nonce makes the old proof worthless.
    sock = socket.create_connection(("127.0.0.1", store.port))
    hello = sock.recv(64)
    nonce = os.urandom(handshake.NONCE_BYTES)
    route = b"store/run"
    sock.sendall(nonce + len(route).to_bytes(2, "big") + route)
    sock.recv(32)
    from orchestrator.trust.secret import mac
    good = mac(SECRET, b"client", hello[len(handshake.MAGIC):], nonce, route)
    sock.sendall(good)
    sock.close()
    replay = socket.create_connection(("127.0.0.1", store.port))
    replay.recv(64)
    replay.sendall(nonce + len(route).to_bytes(2, "big") + route)
    replay.recv(32)
    replay.sendall(good)
    replay.settimeout(5)
    assert replay.recv(1) == b"", "a replayed proof gets the connection closed"
    replay.close()

    garbage = socket.create_connection(("127.0.0.1", store.port))
    try:
        garbage.sendall(os.urandom(4 << 20))
    except OSError:
        pass  # the gate hung up mid-send: what we want
    garbage.close()
    # The gate still serves a client that holds the secret.
    client, relay = store_client(("127.0.0.1", store.port), SECRET)
    try:
        client.set("still", "served")  # torch's set is not acknowledged: wait for the server to apply it
        assert wait_until(lambda: store.client().check(["still"])) and store.client().get("still") == b"served"
    finally:
        relay.close()


def test_a_fake_server_gets_no_proof_from_a_client(tmp_path):
    """A client dialing an address that is not the run's gate hangs up before it proves anything."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    received = bytearray()

    def fake() -> None:
        conn, _ = listener.accept()
        conn.sendall(handshake.MAGIC + os.urandom(handshake.NONCE_BYTES))
        conn.settimeout(5)
        try:
            while chunk := conn.recv(4096):
                received.extend(chunk)
                if len(received) >= handshake.NONCE_BYTES + 2:
                    conn.sendall(os.urandom(32))  # a made-up "proof"
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    with pytest.raises(handshake.HandshakeError, match="could not prove"):
        handshake.connect(listener.getsockname(), SECRET, "store/run")
    thread.join(10)
    route = b"store/run"
    # The fake saw the client's nonce and the route, and nothing derived from the secret.
    assert bytes(received)[handshake.NONCE_BYTES:] == len(route).to_bytes(2, "big") + route
    listener.close()


def test_a_forged_rendezvous_state_is_refused_by_the_store(store, tmp_path):
    """Even a client that got past the gate cannot write a state it did not seal (defence in depth)."""
    marker = tmp_path / "MARKER"
    client, relay = store_client(("127.0.0.1", store.port), SECRET)
    try:
        forged = touching_state(marker)
        assert client.compare_set(rs.state_key(RUN), "", forged) != forged
        client.set(rs.state_key(RUN), forged)
        assert wait_until(lambda: len(store.forged_log) == 2) and not client.check([rs.state_key(RUN)])
        assert store.state(RUN) is None and not marker.exists()
        assert store.forged_log and store.forged_log[0][0] == rs.state_key(RUN)
        sealed = rs.seal(SECRET, rs.state_key(RUN), forged)
        assert client.compare_set(rs.state_key(RUN), "", sealed) == sealed, "a sealed value is written"
    finally:
        relay.close()


def test_an_agent_never_unpickles_a_forged_state_and_the_rendezvous_goes_on(store, tmp_path, monkeypatch):
    """A forged value already in the store (put there behind the store's back): the agent's backend refuses it
    before torch unpickles it, reports it, hands torch a clean state, and torch's next write replaces it."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    marker = tmp_path / "MARKER"
    client, relay = store_client(("127.0.0.1", store.port), SECRET)
    refused: list[str] = []
    try:
        backend = SealedBackend(client, RUN, SECRET, on_refused=refused.append)
        store.kv._data[KEY_PREFIX + rs.state_key(RUN)] = touching_state(marker)  # behind the store's back
        handler = dr.DynamicRendezvousHandler.from_backend(RUN, client, backend, min_nodes=1, max_nodes=1,
                                                           local_addr="127.0.0.1")
        info = handler.next_rendezvous()
        handler._stop_heartbeats()
        assert info.world_size == 1 and not marker.exists()
        assert refused == [rs.state_key(RUN)]
        state = store.state(RUN)
        assert state.complete and [m.pid for m in state.participants] == [os.getpid()], "the forgery was replaced"
    finally:
        relay.close()


AGENT = """
import subprocess, sys, time
from orchestrator.trust.relay import LocalRelay
relay = LocalRelay(("127.0.0.1", int(sys.argv[1])), sys.argv[2], "store/run")
print(relay.port, flush=True)
if len(sys.argv) > 3:  # a worker of this agent: a child process, with torch's client, no secret
    worker = subprocess.run([sys.executable, "-c", sys.argv[3], "127.0.0.1", str(relay.port), "from-the-tree", "1"],
                            capture_output=True, text=True)
    print(worker.stdout.strip(), flush=True)
else:
    time.sleep(120)
"""


@pytest.mark.slow
def test_an_agents_relay_admits_its_own_tree_and_no_stranger_on_the_host(store):
    """An agent (a process holding the secret) relays for its descendants; this test process, a stranger to it
    on the same host and of the same user, gets nothing through it."""
    from security.attackers import STRANGER

    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(store.port), SECRET], stdout=subprocess.PIPE, text=True)
    try:
        port = int(agent.stdout.readline())
        assert stranger_writes("127.0.0.1", port, "from-a-stranger", "1").startswith("REFUSED")
        assert not store.client().check(["from-a-stranger"])
        inside = subprocess.run([sys.executable, "-c", AGENT, str(store.port), SECRET, STRANGER],
                                capture_output=True, text=True, timeout=120)
        assert inside.stdout.split()[-1] == "WROTE", inside.stderr[-2000:]
        assert wait_until(lambda: store.client().check(["from-the-tree"]))
    finally:
        agent.kill()
        agent.wait(10)


def test_a_relay_of_this_process_serves_it(store):
    relay = LocalRelay(("127.0.0.1", store.port), SECRET, "store/run")
    try:
        from torch.distributed import TCPStore

        TCPStore("127.0.0.1", relay.port, is_master=False, timeout=timedelta(seconds=10)).set("mine", "1")
        assert wait_until(lambda: store.client().check(["mine"]))
    finally:
        relay.close()
