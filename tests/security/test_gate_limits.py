"""A flood cannot shut the run's gate: connections past the file-descriptor limit are shed and the gate keeps
accepting, idle connections cost no more threads than the pending-handshake cap, and a client with the secret
gets in once the flood is over. The gate runs in a subprocess of its own with a low ``RLIMIT_NOFILE``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from orchestrator.trust.handshake import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SECRET = "the-runs-secret"

# A gate (echo route) under a low descriptor limit; prints its port, then answers "stats" lines on stdin.
GATE = """
import json, resource, sys, threading
from orchestrator.trust.acceptor import listening_socket
from orchestrator.trust.gate import Gate
soft = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
def echo(sock, peer):
    while data := sock.recv(1024):
        sock.sendall(data)
gate = Gate(listening_socket("127.0.0.1"), sys.argv[1], lambda route: echo if route == "echo" else None,
            max_pending=int(sys.argv[3]), handshake_timeout_s=2.0)
print(gate.port, flush=True)
for line in sys.stdin:
    print(json.dumps({"threads": threading.active_count(), "accept_errors": gate.accept_errors,
                      "refused": gate.refused}), flush=True)
"""


class GateProcess:
    def __init__(self, nofile: int, max_pending: int):
        self.proc = subprocess.Popen([sys.executable, "-c", GATE, SECRET, str(nofile), str(max_pending)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def flood(port: int, n: int) -> list[socket.socket]:
    """``n`` idle connections (the ones the kernel accepts; the gate may shed them as it likes)."""
    held = []
    for _ in range(n):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            pass
    return held


def echo_works(port: int) -> bool:
    sock = connect(("127.0.0.1", port), SECRET, "echo", timeout_s=5)
    try:
        sock.sendall(b"ping")
        return sock.recv(4) == b"ping"
    finally:
        sock.close()


def test_a_burst_past_the_descriptor_limit_is_shed_and_the_gate_keeps_accepting():
    gate = GateProcess(nofile=40, max_pending=64)  # more handshakes allowed than descriptors: EMFILE
    held: list[socket.socket] = []
    try:
        held = flood(gate.port, 300)
        time.sleep(1.0)
        during = gate.stats()
        assert during["accept_errors"] > 0, "the flood did reach the descriptor limit (else this test tests nothing)"
        for sock in held:
            sock.close()
        held = []
        deadline = time.monotonic() + 30
        while True:  # pending handshakes time out in 2 s; the gate then has descriptors again
            try:
                if echo_works(gate.port):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the gate never served again after the flood: {gate.stats()}"
            time.sleep(0.5)
        assert gate.proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        gate.close()


def test_idle_connections_cost_at_most_the_pending_cap_in_threads():
    gate = GateProcess(nofile=4096, max_pending=32)
    held: list[socket.socket] = []
    try:
        baseline = gate.stats()["threads"]
        held = flood(gate.port, 1500)
        time.sleep(1.0)
        stats = gate.stats()
        assert stats["threads"] <= baseline + 32, stats
        assert stats["refused"] > 1000, "connections past the cap were closed at once"
        for sock in held:
            sock.close()
        held = []
        time.sleep(2.5)
        assert echo_works(gate.port)
    finally:
        for sock in held:
            sock.close()
        gate.close()
