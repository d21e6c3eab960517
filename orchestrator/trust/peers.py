"""Who is on the other end of a loopback connection: the process that holds the connecting socket.

TCP has no peer credentials (``SO_PEERCRED`` is for Unix sockets), but Linux lists every socket of this
network namespace in ``/proc/self/net/tcp`` with its inode, and every process's descriptors in
``/proc/<pid>/fd``. A relay that must admit only its own process tree (torchrun's agent and the workers it
started) looks the connecting socket up there: a stranger's process, of the same user or not, is not in the
tree and is refused.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from typing import Iterable, Optional

import psutil

_ESTABLISHED = "01"


TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


def _address(hex_addr: str) -> str:
    """A /proc/net/tcp{,6} address (32-bit words in host order) as text; an IPv4-mapped IPv6 address as its
    IPv4 form (torch's client dials 127.0.0.1 from an IPv6 socket, and the IPv4 listener sees 127.0.0.1)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _endpoint(field: str) -> tuple[str, int]:
    addr, port = field.rsplit(":", 1)
    return _address(addr), int(port, 16)


def socket_inode(local: tuple[str, int], remote: tuple[str, int], tables: Iterable[str] = TABLES) -> Optional[int]:
    """The inode of the established TCP socket (IPv4, or IPv6 carrying IPv4) whose own end is ``local`` and
    whose other end is ``remote`` (for a relay: the client's address as accepted, and the relay's own); None
    when there is none."""
    for table in tables:
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != _ESTABLISHED:
                        continue
                    if _endpoint(fields[1]) == local and _endpoint(fields[2]) == remote:
                        return int(fields[9])
        except (OSError, ValueError, StopIteration):
            continue
    return None


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and every live descendant of it."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


def holder(inode: int, pids: Iterable[int]) -> Optional[int]:
    """The first of ``pids`` that has socket ``inode`` open; None when none of them has."""
    target = f"socket:[{inode}]"
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(f"{fd_dir}/{name}") == target:
                    return pid
            except OSError:
                continue
    return None


def connected_from_tree(peer: tuple[str, int], local: tuple[str, int], root_pid: int) -> Optional[int]:
    """The PID in ``root_pid``'s process tree that opened the connection accepted from ``peer`` on ``local``;
    None when the connecting socket belongs to no process of the tree (or cannot be found)."""
    inode = socket_inode(peer, local)
    if inode is None or inode == 0:
        return None
    return holder(inode, process_tree(root_pid))
