"""iproute2 and /proc, the only tools a test cluster uses: namespaces, links, addresses, processes inside.

Every function here acts on exactly the names it is given; nothing is found or killed by a pattern it did
not derive from a cluster's own name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from orchestrator.errors import OrchError, UserError

NETNS_ETC = Path("/etc/netns")


class NetnsError(OrchError):
    """An iproute2 command failed while building or changing a test cluster."""


def require_root(what: str) -> None:
    """Network namespaces, veths and bridges need root (CAP_NET_ADMIN + CAP_SYS_ADMIN): say so, exit 2."""
    if os.geteuid() != 0:
        raise UserError(f"{what} needs root (network namespaces, veth links and a bridge): running as uid "
                        f"{os.geteuid()}. Fix: run it with sudo, or as root in CI")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            raise UserError(f"{what} needs the `{tool}` command, which is not on PATH. "
                            "Fix: install iproute2 and util-linux (apt-get install iproute2 util-linux)")


def ip(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip [-n NETNS] ARGS``; raises NetnsError with ip's own message when ``check`` and it fails."""
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def in_netns(netns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` inside ``netns`` (``ip netns exec``)."""
    result = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"`ip netns exec {netns} {' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def list_netns() -> list[str]:
    out = ip("-j", "netns", "list", check=False).stdout.strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def links() -> dict[str, dict]:
    """Links of the host namespace by name: ``{"ifname": ..., "operstate": ..., "flags": [...]}``."""
    return {entry["ifname"]: entry for entry in json.loads(ip("-j", "link", "show").stdout or "[]")}


def host_ipv4_networks() -> set[str]:
    """The ``A.B.C`` of every IPv4 address in the host namespace (to pick a subnet nobody uses)."""
    nets = set()
    for entry in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in entry.get("addr_info", []):
            nets.add(a["local"].rsplit(".", 1)[0])
    return nets


def netns_pids(netns: str) -> list[int]:
    """PIDs of every process whose network namespace is ``netns``."""
    result = ip("netns", "pids", netns, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def kill_netns_processes(netns: str, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process in ``netns`` until none is left (a dying parent may have forked); returns PIDs."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = netns_pids(netns)
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in network namespace {netns} survived SIGKILL for {timeout_s} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:  # a dying process stays listed until its parent reaps it
                    killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def write_sysctl(netns: Optional[str], key: str, value: str) -> None:
    """Set ``/proc/sys/KEY`` (dots as slashes) in ``netns`` (None: this namespace)."""
    path = "/proc/sys/" + key.replace(".", "/")
    if netns is None:
        Path(path).write_text(value)
    else:
        in_netns(netns, "sh", "-c", f"echo {value} > {path}")


def netns_etc_dir(netns: str) -> Path:
    """``/etc/netns/<netns>``, refusing (NetnsError) a name that would put it anywhere else: an absolute name,
    one with ``/`` or ``..``, or an empty one."""
    if not netns or "/" in netns or netns in (".", "..") or ".." in netns or "\0" in netns:
        raise NetnsError(f"network namespace name {netns!r} would escape {NETNS_ETC}: refusing to touch it")
    path = NETNS_ETC / netns
    if path.parent != NETNS_ETC:
        raise NetnsError(f"network namespace name {netns!r} would escape {NETNS_ETC}: refusing to touch it")
    return path


def remove_netns(netns: str) -> list[int]:
    """Kill what runs in ``netns``, delete it and its ``/etc/netns`` entry; returns the PIDs killed. Only
    ``/etc/netns/<netns>`` itself is deleted (a symlink there is unlinked, never followed)."""
    etc = netns_etc_dir(netns)
    killed = kill_netns_processes(netns) if netns in list_netns() else []
    if netns in list_netns():
        ip("netns", "del", netns)
    if etc.is_symlink():
        etc.unlink()
    else:
        shutil.rmtree(etc, ignore_errors=True)
    return killed


def remove_link(name: str) -> bool:
    """Delete host link ``name`` (a veth end takes its peer with it); False if it was not there."""
    return ip("link", "del", name, check=False).returncode == 0


def tcp_connections(netns: str) -> list[dict]:
    """Established TCP connections inside ``netns`` (``ss``): ``{"local", "peer", "pids"}``, addresses as
    ``A.B.C.D:PORT`` (IPv4-mapped IPv6 unwrapped)."""
    out = in_netns(netns, "ss", "-tnpH", "state", "established", check=False).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        local, peer = (_plain_address(a) for a in fields[2:4])
        pids = [int(p) for p in re.findall(r"pid=(\d+)", line)]
        found.append({"local": local, "peer": peer, "pids": pids})
    return found


def _plain_address(addr: str) -> str:
    return addr.replace("[::ffff:", "").replace("]", "")
