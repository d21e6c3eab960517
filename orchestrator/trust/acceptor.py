"""Accepting connections without letting a flood, or the operating system, end the listener.

Every listener of a run (the gate, the relays) accepts through :class:`BoundedAcceptor`:

- at most ``max_pending`` connections are being admitted (handshake, peer check) at a time and at most
  ``max_connections`` are being served; a connection past either cap is closed at once, so a burst of idle
  connections costs a file descriptor for an instant, never a thread;
- an accept error never ends the loop. Out of descriptors (EMFILE/ENFILE) the loop sheds the waiting
  connection with a reserved descriptor, logs once every few seconds, and backs off; anything else is logged
  and retried. Only :meth:`close` ends it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 512
"""Connections served at once per listener: a run's agents and workers need a few each."""
DEFAULT_MAX_PENDING = 64
"""Connections being admitted at once per listener (each has a handshake timeout)."""

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
Refused = Callable[[str, str], None]  # (peer "host:port", reason)


def peer_name(peer) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


class BoundedAcceptor:
    """Accepts on ``sock`` (listening) until :meth:`close`; each connection goes to :meth:`admit` (bounded
    by ``max_pending``), then to :meth:`serve` (bounded by ``max_connections``). ``on_refused(peer, reason)``
    hears of every connection turned away."""

    def __init__(self, sock: socket.socket, name: str, on_refused: Optional[Refused] = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_pending: int = DEFAULT_MAX_PENDING):
        self.sock, self.name, self.on_refused = sock, name, on_refused
        self.max_connections, self.max_pending = max_connections, max_pending
        self._pending = threading.BoundedSemaphore(max_pending)
        self._active = threading.BoundedSemaphore(max_connections)
        self._closed = False
        self._live: set[socket.socket] = set()
        self._live_lock = threading.Lock()
        self.refused = 0
        self.accept_errors = 0
        self._reserve: Optional[int] = _reserve_fd()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    # -- what a subclass fills in ------------------------------------------------------------------------------
    def admit(self, conn: socket.socket, peer) -> Optional[object]:
        """Decide on a new connection: None refuses it (after calling :meth:`refuse`), anything else is handed
        to :meth:`serve`."""
        raise NotImplementedError

    def serve(self, conn: socket.socket, peer, admitted: object) -> None:
        """Serve an admitted connection until it ends (the caller closes it)."""
        raise NotImplementedError

    # -- the loop ------------------------------------------------------------------------------------------
    def refuse(self, peer, reason: str) -> None:
        self.refused += 1
        if self.on_refused is not None:
            try:
                self.on_refused(peer_name(peer), reason)
            except Exception:  # a recorder's failure must not end a connection thread's cleanup
                log.exception("%s: on_refused failed", self.name)

    def _accept_loop(self) -> None:
        backoff = 0.0
        last_logged = 0.0
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                self.accept_errors += 1
                now = time.monotonic()
                if now - last_logged > 5.0:
                    log.warning("%s: accept failed (%s); backing off and going on", self.name, exc)
                    last_logged = now
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._shed_one()
                backoff = min(0.5, max(0.01, backoff * 2))
                time.sleep(backoff)
                continue
            backoff = 0.0
            if not self._pending.acquire(blocking=False):
                conn.close()
                self.refuse(peer, f"more than {self.max_pending} connections waiting to be admitted")
                continue
            try:
                threading.Thread(target=self._handle, args=(conn, peer), daemon=True, name=f"{self.name}-conn").start()
            except RuntimeError:  # no thread to be had: shed this one, keep the loop
                self._pending.release()
                conn.close()
                self.refuse(peer, "no thread available")

    def _shed_one(self) -> None:
        """Out of descriptors, the waiting connection stays in the backlog and accept fails again at once: free
        the reserved descriptor, accept and close that connection, then reserve again."""
        if self._reserve is None:
            return
        os.close(self._reserve)
        self._reserve = None
        try:
            conn, peer = self.sock.accept()
            conn.close()
            self.refuse(peer, "out of file descriptors")
        except OSError:
            pass
        finally:
            self._reserve = _reserve_fd()

    def _handle(self, conn: socket.socket, peer) -> None:
        with self._live_lock:
            self._live.add(conn)
        try:
            try:
                admitted = self.admit(conn, peer)
            finally:
                self._pending.release()
            if admitted is None:
                return
            if not self._active.acquire(blocking=False):
                self.refuse(peer, f"more than {self.max_connections} connections at once")
                return
            try:
                self.serve(conn, peer, admitted)
            finally:
                self._active.release()
        except OSError:
            pass
        except Exception:
            log.exception("%s: connection from %s failed", self.name, peer_name(peer))
        finally:
            with self._live_lock:
                self._live.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop accepting and end every connection still open (their clients see the next call fail)."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._live_lock:
            live, self._live = list(self._live), set()
        for conn in live:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None


def _reserve_fd() -> Optional[int]:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes; returns when both directions are done."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    other = threading.Thread(target=pump, args=(b, a), daemon=True, name="orch-relay")
    other.start()
    pump(a, b)
    other.join()
    b.close()


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``address``:``port`` only (0: a free port). ``"0.0.0.0"`` or ``"::"`` listen
    on every interface: orch does that only where asked (a pod's store, behind its NetworkPolicy)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # every interface, IPv4 too
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock
