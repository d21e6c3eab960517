"""The TCP connections a gloo process group opened, and cutting them when it is aborted.

gloo's own ``abort`` does not end a collective already waiting on a peer: a receive from a peer that froze
without closing its connections (a stopped process, a frozen VM, a network partition) waits out the process
group's timeout (``fault_tolerance.collective_timeout_s``) whatever is aborted meanwhile. Shutting the process
group's sockets down ends every wait on them at once (gloo raises "Connection closed by peer"), here and in
every live peer blocked on this worker. gloo connects every pair of its process group before its constructor
returns, so its sockets are the ones that appeared meanwhile: :func:`opened_since` tells them from the rest, and
:func:`cut` shuts them down. Linux only (``/proc/self/fd``); elsewhere, or with torch's ``TORCH_GLOO_LAZY_INIT=1``
(gloo then connects at the first collective), nothing is found and an abort stays gloo's own.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator, Optional

Sockets = dict[int, int]  # fd -> the socket's inode (an fd number is reused once closed; the inode is not)


def open_sockets() -> Sockets:
    """This process's open sockets (empty where ``/proc/self/fd`` does not exist)."""
    found: Sockets = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (or the listing's own fd)
            continue
        if link.startswith("socket:["):
            found[int(fd)] = int(link[len("socket:["):-1])
    return found


@contextlib.contextmanager
def _pinned(fd: int, inode: int) -> Iterator[Optional[socket.socket]]:
    """Socket ``fd`` through a duplicate of the fd (which pins the socket whatever happens to ``fd`` meanwhile),
    if it still is socket ``inode``; else None. Only the duplicate is closed afterwards."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    try:
        yield sock if os.fstat(dup).st_ino == inode else None
    finally:
        sock.close()


def _inspect(fd: int, inode: int) -> Optional[tuple[bool, tuple, Optional[tuple]]]:
    """(listening, local address, peer address or None) of TCP socket ``fd`` if it still is socket ``inode``."""
    with _pinned(fd, inode) as sock:
        if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            try:
                peer: Optional[tuple] = sock.getpeername()[:2]
            except OSError:
                peer = None
            return listening, sock.getsockname()[:2], peer
        except OSError:
            return None


def opened_since(before: Sockets) -> list[tuple[int, int]]:
    """The connected TCP sockets opened since ``before`` was taken, as (fd, inode): a process group's pairs,
    when ``before`` was taken just before it was made. Left out, as not the process group's: a connection
    accepted by, or made to, a listener of this process that was already open (this worker's peer state
    server), and one to an address that an older socket is connected to too (orch's own clients reconnecting to
    the run's gate or the store relay). gloo's pairs are accepted on its new listener or connect to a peer's new
    one."""
    old_listeners: set[int] = set()
    old_peers: set[tuple] = set()  # the addresses of older listeners and older connections' peers
    now = open_sockets()
    for fd, inode in before.items():
        if now.get(fd) != inode:
            continue
        seen = _inspect(fd, inode)
        if seen is None:
            continue
        listening, local, peer = seen
        if listening:
            old_listeners.add(local[1])
            old_peers.add(local)
        elif peer is not None:
            old_peers.add(peer)
    opened = []
    for fd, inode in now.items():
        if before.get(fd) == inode:
            continue
        seen = _inspect(fd, inode)
        if seen is None:
            continue
        listening, local, peer = seen
        if listening or peer is None or local[1] in old_listeners or peer in old_peers:
            continue
        opened.append((fd, inode))
    return opened


def cut(sockets: list[tuple[int, int]]) -> int:
    """Shut down (both ways) each of ``sockets`` that is still open as the same socket; the fds stay open for
    their owner to close. Never a listening socket (gloo's listener thread dies on one). Returns how many."""
    done = 0
    for fd, inode in sockets:
        with _pinned(fd, inode) as sock:
            if sock is None:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:
                pass  # not connected any more
    return done
