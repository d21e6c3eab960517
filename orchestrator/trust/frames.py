"""Length-prefixed frames on an authenticated socket: how orch's own services (the per_step quorum service, a
peer's state server) talk once the handshake is done. A frame is an 8-byte big-endian length and the bytes;
JSON frames hold one object. Nothing is unpickled, and a frame past its limit ends the connection."""

from __future__ import annotations

import json
import socket
from typing import Any

MAX_JSON_FRAME = 16 * 1024 * 1024
MAX_BYTES_FRAME = 64 * 1024 * 1024 * 1024  # a whole training state, for the peer state server


class FrameError(ConnectionError):
    """The other side sent something that is not a frame (or one past the limit), or hung up mid-frame."""


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise FrameError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_bytes(sock: socket.socket, data: bytes) -> None:
    sock.sendall(len(data).to_bytes(8, "big") + data)


def recv_bytes(sock: socket.socket, limit: int = MAX_BYTES_FRAME) -> bytes:
    n = int.from_bytes(_recv_exactly(sock, 8), "big")
    if n > limit:
        raise FrameError(f"a frame of {n} bytes (at most {limit})")
    return _recv_exactly(sock, n)


def send_json(sock: socket.socket, obj: Any) -> None:
    send_bytes(sock, json.dumps(obj, separators=(",", ":")).encode())


def recv_json(sock: socket.socket) -> Any:
    data = recv_bytes(sock, MAX_JSON_FRAME)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"not a JSON frame ({exc})") from None
