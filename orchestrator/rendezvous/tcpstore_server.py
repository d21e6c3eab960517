"""torch's TCPStore wire protocol, served by orch on one connection against a :class:`KeyValueStore`.

orch's gate admits a client only after the handshake (:mod:`orchestrator.trust`), then hands the connection
here: from then on the client (torch's own TCPStore client, through an agent's relay) speaks the protocol it
always speaks. Serving it in this process means no TCPStore server of a run listens on any port, loopback
included, where a stranger could reach it.

The protocol, as torch's client sends it (checked against every supported torch by
tests/test_tcpstore_protocol.py): one command byte, then its fields; strings and values are a little-endian
u64 length and the bytes; counts and integers are little-endian 64-bit. A client opens with ``VALIDATE``
(a magic number) and ``PING`` (a nonce it expects back).
"""

from __future__ import annotations

import socket
import struct
import threading
from enum import IntEnum
from typing import Callable, Optional

from orchestrator.rendezvous.kvstore import KeyValueStore

VALIDATION_MAGIC = 0x3C85F7CE
MAX_KEY_BYTES = 8 * 1024
MAX_VALUE_BYTES = 64 * 1024 * 1024
MAX_KEYS = 128 * 1024


class Query(IntEnum):
    """torch's ``c10d::detail::QueryType`` (TCPStoreBackend.hpp), in its order."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16


CHECK_READY, CHECK_NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1


class ProtocolError(ConnectionError):
    """A client that does not speak torch's store protocol (or exceeds its limits): the connection ends."""


class _Reader:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise EOFError
            self.buf += chunk
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def u8(self) -> int:
        return self.exactly(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.exactly(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.exactly(8))[0]

    def i64(self) -> int:
        return struct.unpack("<q", self.exactly(8))[0]

    def key(self) -> str:
        n = self.u64()
        if n > MAX_KEY_BYTES:
            raise ProtocolError(f"key of {n} bytes")
        return self.exactly(n).decode("utf-8", errors="surrogateescape")

    def value(self) -> bytes:
        n = self.u64()
        if n > MAX_VALUE_BYTES:
            raise ProtocolError(f"value of {n} bytes")
        return self.exactly(n)

    def keys(self) -> list[str]:
        n = self.u64()
        if n > MAX_KEYS:
            raise ProtocolError(f"{n} keys in one query")
        return [self.key() for _ in range(n)]


def _vec(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


class StoreConnection:
    """Serves one client connection until it closes (:meth:`run`)."""

    def __init__(self, sock: socket.socket, store: KeyValueStore, peer: str = "?"):
        self.sock, self.store, self.peer = sock, store, peer
        self._send_lock = threading.Lock()
        self._cancel_wait: Optional[Callable[[], bool]] = None
        self._validated = False

    def send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def run(self) -> None:
        reader = _Reader(self.sock)
        try:
            while True:
                self._one(reader, reader.u8())
        except (EOFError, ConnectionError, OSError, ValueError):
            pass
        finally:
            if self._cancel_wait is not None:
                self._cancel_wait()

    def _one(self, r: _Reader, command: int) -> None:
        try:
            q = Query(command)
        except ValueError:
            raise ProtocolError(f"unknown command {command}") from None
        if not self._validated:
            if q is not Query.VALIDATE or r.u32() != VALIDATION_MAGIC:
                raise ProtocolError("a store client must validate first")
            self._validated = True
            return
        s, peer = self.store, self.peer
        if q is Query.VALIDATE:
            r.u32()
        elif q is Query.PING:
            self.send(struct.pack("<I", r.u32()))
        elif q is Query.SET:
            key = r.key()
            s.set(key, r.value(), peer)
        elif q is Query.COMPARE_SET:
            key = r.key()
            expected = r.value()
            self.send(_vec(s.compare_set(key, expected, r.value(), peer)))
        elif q is Query.GET:
            self.send(_vec(s.get(r.key()) or b""))
        elif q is Query.ADD:
            key = r.key()
            self.send(struct.pack("<q", s.add(key, r.i64(), peer)))
        elif q is Query.CHECK:
            self.send(bytes([CHECK_READY if s.check(r.keys()) else CHECK_NOT_READY]))
        elif q is Query.WAIT:
            self._wait(r.keys())
        elif q is Query.GETNUMKEYS:
            self.send(struct.pack("<q", s.num_keys()))
        elif q is Query.DELETE_KEY:
            self.send(struct.pack("<q", int(s.delete(r.key()))))
        elif q is Query.APPEND:
            key = r.key()
            s.append(key, r.value(), peer)
        elif q is Query.MULTI_GET:
            self.send(b"".join(_vec(s.get(k) or b"") for k in r.keys()))
        elif q is Query.MULTI_SET:
            for _ in range(self._count(r)):
                key = r.key()
                s.set(key, r.value(), peer)
        elif q is Query.CANCEL_WAIT:
            if self._cancel_wait is not None:
                self._cancel_wait()
                self._cancel_wait = None
            self.send(bytes([WAIT_CANCELED]))
        elif q is Query.QUEUE_PUSH:
            key = r.key()
            s.queue_push(key, r.value(), peer)
        elif q is Query.QUEUE_POP:
            s.queue_pop(r.key(), lambda value: self.send(_vec(value)))
        elif q is Query.QUEUE_LEN:
            self.send(struct.pack("<q", s.queue_len(r.key())))

    @staticmethod
    def _count(r: _Reader) -> int:
        n = r.u64()
        if n > MAX_KEYS:
            raise ProtocolError(f"{n} keys in one query")
        return n

    def _wait(self, keys: list[str]) -> None:
        # Answered from whichever thread completes the keys; a client that gives up sends CANCEL_WAIT.
        def done() -> None:
            self._cancel_wait = None
            self.send(bytes([STOP_WAITING]))

        self._cancel_wait = self.store.when_present(keys, done)


def serve_store(store: KeyValueStore) -> Callable[[socket.socket, str], None]:
    """A gate handler that serves ``store`` on each connection it is given."""

    def handler(sock: socket.socket, peer: str) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        StoreConnection(sock, store, peer).run()

    return handler
