"""A challenge-response in both directions, over any connected stream socket, before a single byte of the
protocol it guards. Neither side ever sends the secret, and the server proves itself first:

1. server -> client: ``MAGIC`` + a fresh server nonce;
2. client -> server: a fresh client nonce, then the route (what the client wants: ``store/run``, ``quorum``, ...);
3. server -> client: MAC(secret, "server", server nonce, client nonce, route);
4. client: checks it, and hangs up on a server that cannot prove it holds the secret (a fake one learns
   nothing: not even a proof); then client -> server: MAC(secret, "client", ...the same...).
5. server: checks it, and hangs up on a client that cannot.

Fresh nonces on both sides make every proof good for one connection only (a recorded handshake replays to
nothing), and the two labels keep a server's proof from ever serving as a client's. What this does not stop
is an active man in the middle relaying both directions: that needs encryption, which orch leaves to the
network (docs/security.md).
"""

from __future__ import annotations

import os
import socket
from typing import Union

from orchestrator.trust.secret import MAC_BYTES, mac, verify

MAGIC = b"orch-trust/1\n"
NONCE_BYTES = 16
MAX_ROUTE_BYTES = 512
HANDSHAKE_TIMEOUT_S = 5.0
Address = Union[tuple[str, int], str]


class HandshakeError(ConnectionError):
    """The other side did not complete the handshake: no proof, a wrong one, garbage, or silence."""


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise HandshakeError(f"connection closed after {len(data)} of {n} handshake bytes")
        data += chunk
    return bytes(data)


def serve(sock: socket.socket, secret: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> str:
    """The server's side on an accepted ``sock``: returns the route a proven client asked for. Raises
    HandshakeError (or OSError, or socket.timeout) for anyone else; the caller closes the socket then."""
    sock.settimeout(timeout_s)
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    client_nonce = _recv_exactly(sock, NONCE_BYTES)
    n = int.from_bytes(_recv_exactly(sock, 2), "big")
    if n > MAX_ROUTE_BYTES:
        raise HandshakeError(f"route of {n} bytes (at most {MAX_ROUTE_BYTES})")
    route = _recv_exactly(sock, n)
    sock.sendall(mac(secret, b"server", server_nonce, client_nonce, route))
    proof = _recv_exactly(sock, MAC_BYTES)
    if not verify(secret, proof, b"client", server_nonce, client_nonce, route):
        raise HandshakeError("no proof of the run's secret")
    sock.settimeout(None)
    try:
        return route.decode()
    except UnicodeDecodeError:
        raise HandshakeError("route is not UTF-8") from None


def authenticate(sock: socket.socket, secret: str, route: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The client's side on a connected ``sock``: proves the secret for ``route`` once the server has proven
    it. Raises HandshakeError when the server is not orch's or cannot prove it holds the secret."""
    sock.settimeout(timeout_s)
    hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise HandshakeError("not an orch gate (no handshake greeting)")
    server_nonce = hello[len(MAGIC):]
    client_nonce = os.urandom(NONCE_BYTES)
    encoded = route.encode()
    sock.sendall(client_nonce + len(encoded).to_bytes(2, "big") + encoded)
    answer = _recv_exactly(sock, MAC_BYTES)
    if not verify(secret, answer, b"server", server_nonce, client_nonce, encoded):
        raise HandshakeError("the server could not prove it holds the run's secret")
    sock.sendall(mac(secret, b"client", server_nonce, client_nonce, encoded))
    sock.settimeout(None)


def connect(address: tuple[str, int], secret: str, route: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """A socket to the gate at ``address``, authenticated both ways for ``route`` (blocking, no timeout)."""
    host, port = address
    sock = socket.create_connection((host.strip("[]"), port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        authenticate(sock, secret, route, timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock
