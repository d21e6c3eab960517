"""What a pickle in the rendezvous store can and cannot do to orch's driver: the store refuses a state without the
run's seal, and a payload that got there anyway never runs code in orch (the seal is checked first, and decode
resolves only the classes of torch's state); the store opens one port, on the plan's address only. Fast: one
store on loopback (the attacks on the gate itself are in tests/security/)."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from orchestrator.rendezvous import RendezvousStore
from orchestrator.rendezvous import state as rs
from orchestrator.rendezvous.kvstore import KEY_PREFIX
from orchestrator.rendezvous.rounds import RoundWatch
from security.attackers import STRANGER

pytestmark = pytest.mark.timeout(60)

RUN = "job"


def payload_via_reduce(func, *args) -> bytes:
    """A pickle whose loading calls ``func(*args)``, as an attacker's ``__reduce__`` writes it."""

    class Evil:
        def __reduce__(self):
            return func, args

    return pickle.dumps(Evil())


def global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-0 pickle calling ``module.name(arg)``, naming the module literally (``os``, not ``posix``)."""
    return f"c{module}\n{name}\n(V{arg}\ntR.".encode()


def inside_a_real_state(evil: object) -> bytes:
    """torch's own state class carrying ``evil`` in a field: the payload is not at the top of the pickle."""
    state = dr._RendezvousState()
    state.participants = {dr._NodeDesc("127.0.0.1", 1, 0): 0}
    state.future_field = evil
    return pickle.dumps(state)


class _Touch:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (the pickle, the class decode must name when it refuses it). Each but the attribute lookup would
    create ``marker`` under a plain ``pickle.loads``."""
    touch = f"touch {marker}"
    return {
        "os.system": (global_call("os", "system", touch), "os.system"),
        "posix.system": (payload_via_reduce(os.system, touch), "posix.system"),
        "subprocess.Popen": (payload_via_reduce(subprocess.Popen, ["touch", str(marker)]), "subprocess.Popen"),
        "builtins.eval": (payload_via_reduce(eval, f"__import__('os').system({touch!r})"), "builtins.eval"),
        "builtins.exec": (global_call("builtins", "exec", f"import os; os.system({touch!r})"), "builtins.exec"),
        # A module torch's state does come from, but an attribute that is not one of its classes.
        "dynamic_rendezvous.os": (global_call("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "os", "x"),
                                  "torch.distributed.elastic.rendezvous.dynamic_rendezvous.os"),
        "nested in a real state": (inside_a_real_state(_Touch(marker)), "posix.system"),
    }


SECRET = "the-runs-secret"


@pytest.fixture
def store():
    store = RendezvousStore(secret=SECRET)
    yield store
    store.close()


def full_state() -> rs.RendezvousState:
    a, b, c = rs.Member("10.0.0.1", 11, 0), rs.Member("10.0.0.2", 22, 1), rs.Member("10.0.0.3", 33, 0)
    now = datetime.now(timezone.utc)
    return rs.RendezvousState(round=4, complete=False, closed=False, deadline=now + timedelta(seconds=9),
                              participants={a: 0}, wait_list={b}, redundancy_list={c},
                              last_heartbeats={a: now, b: now - timedelta(seconds=3)}, extra={"future": [1, {2}]})


def test_a_real_state_round_trips_through_the_restricted_decode():
    state = full_state()
    assert rs.decode(rs.encode(state)) == state


def test_a_state_torch_wrote_decodes(store):
    state = dr._RendezvousState()
    state.round, state.complete = 2, True
    state.participants = {dr._NodeDesc("127.0.0.1", 5, 0): 0}
    state.last_heartbeats = {dr._NodeDesc("127.0.0.1", 5, 0): datetime.now(timezone.utc)}
    decoded = rs.decode(base64.b64encode(pickle.dumps(state)))
    assert decoded.round == 2 and decoded.participants == {rs.Member("127.0.0.1", 5, 0): 0}


@pytest.mark.parametrize("name", list(payloads(Path("/nonexistent"))))
def test_decode_refuses_a_payload_naming_its_class_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "MARKER"
    pickled, cls = payloads(marker)[name]
    with pytest.raises(rs.RendezvousStateError) as refused:
        rs.decode(base64.b64encode(pickled), rs.state_key(RUN))
    message = str(refused.value)
    assert f"refused to unpickle {cls}:" in message and "\n" not in message, message
    assert not marker.exists()


@pytest.mark.parametrize("name", list(payloads(Path("/nonexistent"))))
def test_a_payload_in_the_store_is_left_alone_by_evict_roundwatch_and_read_state(store, tmp_path, name):
    """A payload in the store (put there behind the store's back: its write policy refuses unsealed states)."""
    marker = tmp_path / "MARKER"
    pickled, cls = payloads(marker)[name]
    raw = base64.b64encode(pickled)
    client = store.client()
    client.set(rs.state_key(RUN), raw)
    assert not client.check([rs.state_key(RUN)]), "the store refuses a state without the run's seal"
    store.kv._data[KEY_PREFIX + rs.state_key(RUN)] = raw

    assert not store.evict(RUN, 11)
    watch = RoundWatch(store.client, RUN, silence_s=1, secret=SECRET)
    try:
        assert watch.members() is None and watch.silent() == []
    finally:
        watch.close()
    with pytest.raises(rs.ForgedStateError):
        store.state(RUN)
    with pytest.raises(rs.RendezvousStateError, match=f"refused to unpickle {cls}:"):
        rs.read_state(client, RUN)  # without the seal check, the restricted unpickler still refuses it

    assert client.get(rs.state_key(RUN)) == raw  # nobody rewrote it
    assert not marker.exists()


def listening(port: int) -> list[tuple[str, int]]:
    """The local addresses of this process's sockets listening on ``port``."""
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def test_the_store_opens_one_port_on_the_plans_address_only():
    before = listening_ports()
    store = RendezvousStore("127.0.0.1", 0, secret=SECRET)
    try:
        assert listening_ports() - before == {store.port}, "no TCPStore server behind the gate, not even on loopback"
        assert listening(store.port) == [("127.0.0.1", store.port)]
        client = store.client()
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        port = store.port
        store.close()
    assert listening(port) == []


def test_a_store_asked_to_listen_everywhere_does():
    store = RendezvousStore("127.0.0.1", 0, listen="0.0.0.0", secret=SECRET)
    try:
        assert listening(store.port) == [("0.0.0.0", store.port)]
        assert store.client().check(["nothing"]) is False
    finally:
        store.close()


def test_a_port_in_use_is_an_error_not_a_shared_server():
    first = RendezvousStore("127.0.0.1", 0, secret=SECRET)
    try:
        with pytest.raises(OSError):
            RendezvousStore("127.0.0.1", first.port, secret=SECRET)
    finally:
        first.close()


def test_a_hosted_store_needs_the_runs_secret():
    with pytest.raises(ValueError, match="secret"):
        RendezvousStore("127.0.0.1", 0, secret="")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.testcluster(nodes=1)
def test_on_a_test_host_a_client_without_the_secret_is_refused_and_the_payload_never_runs(testcluster, tmp_path):
    from orchestrator.testcluster.state import enter_argv

    tc, refused = testcluster, []
    store = RendezvousStore(tc.store_address, 0, secret=SECRET, on_refused=lambda peer, why: refused.append(peer))
    on_host = lambda argv: list(enter_argv(tc.netns[0], tc.hostnames[0], argv))  # noqa: E731
    marker = tmp_path / "MARKER"
    try:
        assert listening(store.port) == [(tc.store_address, store.port)]
        pickled, _ = payloads(marker)["os.system"]
        argv = on_host([sys.executable, "-c", STRANGER, store.host, str(store.port), rs.state_key(RUN),
                        base64.b64encode(pickled).decode()])
        verdict = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert verdict.startswith("REFUSED") and not marker.exists() and store.state(RUN) is None
        assert refused and refused[0].startswith(tc.addresses[0] + ":"), refused
        member = subprocess.run(on_host([sys.executable, "-c", MEMBER, store.host, str(store.port)]),
                                capture_output=True, text=True, timeout=60, env={**os.environ, "ORCH_RUN_SECRET": SECRET})
        assert member.stdout.strip() == "WROTE", member.stderr[-2000:]
        deadline = time.monotonic() + 10
        while not store.client().check(["member"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.client().get("member") == b"was here"
    finally:
        store.close()


# A client holding the secret (ORCH_RUN_SECRET in its environment), through a relay of its own, as agents do.
MEMBER = """
import os, sys
from orchestrator.rendezvous.agent import store_client
client, relay = store_client((sys.argv[1], int(sys.argv[2])), os.environ["ORCH_RUN_SECRET"])
client.set("member", "was here")
client.get("member")
print("WROTE")
"""
