"""``orch testcluster up|down|status|partition|heal|kill``: N test hosts as network namespaces on one bridge.

Layout of cluster NAME with N nodes on a free ``10.213.S.0/24``:

    host namespace: bridge ot<tag>br, 10.213.S.1 (the rendezvous store listens here), hostname NAME-host
      +-- veth ot<tag>n0 <-> eth0 in namespace orch-NAME-node0: 10.213.S.10, hostname NAME-node0, lo up
      +-- veth ot<tag>n1 <-> eth0 in namespace orch-NAME-node1: 10.213.S.11, hostname NAME-node1, lo up
      ...

Every node's ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` binds over /etc/hosts)
names the host and every node, and its ``nsswitch.conf`` resolves hosts from files only. The host
namespace's ``/etc/hosts`` gets the same names in a marked block, removed by ``down``: c10d reverse-resolves
every address it connects to or accepts, and without the block those lookups would go to the machine's DNS
server; with it, no lookup and no packet about a test cluster ever leaves the machine. Faults: ``partition`` sets a node's bridge port down (its processes keep
running, cut off), ``heal`` sets it up, ``kill`` SIGKILLs every process in the node's namespace; each is
appended to the cluster's fault log, which a launcher running on the cluster turns into run events.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from orchestrator.rundir import append_jsonl, read_jsonl
from orchestrator.testcluster import netns as nx
from orchestrator.testcluster.state import (
    SUBNET_PREFIX, ClusterState, check_name, faults_path, hosts_backup_path, link_re, link_tag, load_state,
    netns_re, plan_cluster, require_state, state_dir, state_path,
)


@contextmanager
def _lock() -> Iterator[None]:
    """Serialize up/down on this machine (subnet choice, same-name races)."""
    state_dir().mkdir(parents=True, exist_ok=True)
    with (state_dir() / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnet(name: str) -> int:
    """A ``10.213.S`` nobody uses: no address in the host namespace, no other cluster's state file."""
    used = {n for n in nx.host_ipv4_networks() if n.startswith(SUBNET_PREFIX + ".")}
    for path in state_dir().glob("*.json"):
        try:
            used.add(ClusterState.from_dict(json.loads(path.read_text())).subnet.rsplit(".", 1)[0])
        except (ValueError, KeyError, TypeError):
            continue
    start = int(link_tag(name), 16) % 250
    for k in range(250):
        s = 1 + (start + k) % 250
        if f"{SUBNET_PREFIX}.{s}" not in used:
            return s
    raise nx.NetnsError(f"every {SUBNET_PREFIX}.S.0/24 is in use. Fix: `orch testcluster down` unused clusters")


def up(name: str, nodes: int) -> ClusterState:
    """Create cluster ``name`` with ``nodes`` hosts, first removing what a same-named cluster left behind."""
    nx.require_root("orch testcluster up")
    check_name(name)
    with _lock():
        _remove(name)
        state = plan_cluster(name, nodes, _free_subnet(name), created_t=time.time())
        # Recorded before anything exists: a crash half-way leaves a state file that `down` can follow.
        state_path(name).write_text(state.to_json() + "\n")
        try:
            _create(state)
        except BaseException:
            _remove(name)
            raise
    return state


def _create(state: ClusterState) -> None:
    prefix = int(state.subnet.split("/")[1])
    nx.ip("link", "add", state.bridge, "type", "bridge")
    nx.write_sysctl(None, f"net.ipv6.conf.{state.bridge}.disable_ipv6", "1")
    nx.ip("addr", "add", f"{state.bridge_address}/{prefix}", "dev", state.bridge)
    nx.ip("link", "set", state.bridge, "up")
    hosts = state.hosts_file()
    _edit_host_hosts(state.name, state.hosts_block())
    for node in state.nodes:
        nx.ip("netns", "add", node.netns)
        etc = nx.netns_etc_dir(node.netns)
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)
        (etc / "nsswitch.conf").write_text(_files_only_nsswitch())
        (etc / "resolv.conf").write_text("# orch testcluster: names come from /etc/hosts; no DNS server here\n")
        # IPv4 only: a link-local IPv6 address on eth0 could be what gloo picks for GLOO_SOCKET_IFNAME.
        for key in ("all", "default"):
            nx.write_sysctl(node.netns, f"net.ipv6.conf.{key}.disable_ipv6", "1")
        nx.ip("link", "add", node.host_link, "type", "veth", "peer", "name", node.ifname, "netns", node.netns)
        nx.ip("link", "set", node.host_link, "master", state.bridge)
        nx.ip("link", "set", node.host_link, "up")
        nx.ip("addr", "add", f"{node.address}/{prefix}", "dev", node.ifname, netns=node.netns)
        nx.ip("link", "set", node.ifname, "up", netns=node.netns)
        nx.ip("link", "set", "lo", "up", netns=node.netns)


HOSTS_FILE = Path("/etc/hosts")
NSSWITCH_FILE = Path("/etc/nsswitch.conf")


def _block_markers(name: str) -> tuple[str, str]:
    return f"# BEGIN orch testcluster {name}", f"# END orch testcluster {name}"


def _edit_host_hosts(name: str, block: str = "") -> bool:
    """Replace cluster ``name``'s marked block in the host's /etc/hosts with ``block`` (empty: remove it).
    Returns whether a block was there. Adding a block first keeps the previous content in
    :func:`hosts_backup_path` (``down`` deletes it once the block is gone); see :func:`_write_hosts`."""
    begin, end = _block_markers(name)
    text = HOSTS_FILE.read_text() if HOSTS_FILE.exists() else ""
    kept, inside, found = [], False, False
    for line in text.splitlines():
        if line == begin:
            inside = found = True
        elif line == end and inside:
            inside = False
        elif not inside:
            kept.append(line)
    if block:
        backup = hosts_backup_path(name)
        if not backup.exists():
            write_text_atomic(backup, text)
        kept += [begin, *block.splitlines(), end]
    if found or block:
        _write_hosts("\n".join(kept) + "\n", name)
    return found


def _write_hosts(text: str, name: str) -> None:
    """Write /etc/hosts atomically: a temporary file in /etc (same owner and mode) renamed over it, so a
    reader (or a crash) sees the old or the new file, whole. Where /etc/hosts is a mount point (Docker
    bind-mounts it) a rename cannot replace it: only then is it rewritten in place, the backup file
    being what restores it."""
    tmp = HOSTS_FILE.with_name(f".{HOSTS_FILE.name}.orch-{name}.{os.getpid()}.tmp")
    try:
        st = HOSTS_FILE.stat() if HOSTS_FILE.exists() else None
        tmp.unlink(missing_ok=True)  # left by a crashed edit of the same PID
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, st.st_mode & 0o7777 if st else 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if st:
            os.chown(tmp, st.st_uid, st.st_gid)
            os.chmod(tmp, st.st_mode & 0o7777)
        try:
            os.replace(tmp, HOSTS_FILE)
            return
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM):
                raise
        with HOSTS_FILE.open("r+") as f:
            f.write(text)
            f.truncate()
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _files_only_nsswitch() -> str:
    """This machine's nsswitch.conf with ``hosts: files``: a name lookup inside a test host never asks DNS."""
    text = NSSWITCH_FILE.read_text() if NSSWITCH_FILE.exists() else ""
    lines = [l for l in text.splitlines() if not l.split(":", 1)[0].strip() == "hosts"]
    return "\n".join([*lines, "hosts:          files"]) + "\n"


def _own_netns(name: str) -> list[str]:
    """Namespaces of cluster ``name``: exactly ``orch-NAME-node<digits>``."""
    own = netns_re(name)
    return [n for n in nx.list_netns() if own.fullmatch(n)]


def _own_links(name: str) -> list[str]:
    """Host links of cluster ``name``: ``ot<tag>br`` and ``ot<tag>n<digits>``."""
    own = link_re(name)
    return [l for l in nx.links() if own.fullmatch(l)]


def down(name: str) -> dict:
    """Remove everything cluster ``name`` made: processes inside, namespaces, links, bridge, /etc/netns
    entries, state. Returns what was removed and ``left`` (anything still there: should be empty)."""
    nx.require_root("orch testcluster down")
    check_name(name)
    with _lock():
        removed = _remove(name)
    removed["left"] = leftovers(name)
    return removed


def _remove(name: str) -> dict:
    state = load_state(name)
    spaces = sorted(set(_own_netns(name)) | set(state.netns_names if state else ()))
    killed: list[int] = []
    for ns in spaces:
        killed += nx.remove_netns(ns)
    links = [l for l in _own_links(name) if nx.remove_link(l)]
    _edit_host_hosts(name)
    for path in (state_path(name), faults_path(name), hosts_backup_path(name)):
        path.unlink(missing_ok=True)
    return {"name": name, "namespaces": spaces, "links": links, "killed_pids": killed}


def leftovers(name: str) -> list[str]:
    """What of cluster ``name`` still exists (namespaces, links, processes, files); [] after a clean down."""
    left = [f"netns {n}" for n in _own_netns(name)] + [f"link {l}" for l in _own_links(name)]
    left += [f"pid {p} in {n}" for n in _own_netns(name) for p in nx.netns_pids(n)]
    tag_dirs = [p for p in nx.NETNS_ETC.glob(f"orch-{name}-node*")] if nx.NETNS_ETC.exists() else []
    left += [f"dir {p}" for p in tag_dirs]
    left += [f"file {p}" for p in (state_path(name), faults_path(name), hosts_backup_path(name)) if p.exists()]
    if HOSTS_FILE.exists() and _block_markers(name)[0] in HOSTS_FILE.read_text().splitlines():
        left.append(f"block in {HOSTS_FILE}")
    return left


def record_fault(state: ClusterState, fault: str, node: int, t: float, **fields) -> dict:
    """Append a fault that happened at ``t`` to the cluster's fault log."""
    record = {"t": t, "fault": fault, "node": node, "hostname": state.nodes[node].hostname, **fields}
    append_jsonl(faults_path(state.name), record)
    return record


def partition(name: str, node: int) -> dict:
    """Cut ``node`` off the network (its bridge port down); its processes keep running."""
    nx.require_root("orch testcluster partition")
    state, t = require_state(name), time.time()
    nx.ip("link", "set", state.node(node).host_link, "down")
    return record_fault(state, "partition", node, t)


def heal(name: str, node: int) -> dict:
    """Reconnect ``node`` (its bridge port up)."""
    nx.require_root("orch testcluster heal")
    state, t = require_state(name), time.time()
    nx.ip("link", "set", state.node(node).host_link, "up")
    return record_fault(state, "heal", node, t)


def kill(name: str, node: int) -> dict:
    """SIGKILL every process in ``node``'s namespace (a host crash)."""
    nx.require_root("orch testcluster kill")
    state, t = require_state(name), time.time()
    pids = nx.kill_netns_processes(state.node(node).netns)
    return record_fault(state, "kill", node, t, pids=pids)


def faults(name: str, since: float = 0.0) -> list[dict]:
    """The cluster's faults at or after ``since`` (unix seconds)."""
    return [f for f in read_jsonl(faults_path(name)) if f["t"] >= since]


def link_up(state: ClusterState, node: int) -> bool:
    """Whether ``node``'s bridge port is up (False while partitioned)."""
    entry = nx.links().get(state.nodes[node].host_link)
    return bool(entry) and "UP" in entry.get("flags", [])


def status(name: str) -> dict:
    """Cluster ``name`` as it is now: per node its namespace, address, link and process count."""
    state = require_state(name)
    existing, host_links = set(nx.list_netns()), nx.links()
    nodes = []
    for n in state.nodes:
        link = host_links.get(n.host_link)
        nodes.append({"node": n.index, "hostname": n.hostname, "address": n.address, "netns": n.netns,
                      "netns_exists": n.netns in existing,
                      "link": ("up" if "UP" in link.get("flags", []) else "down (partitioned)") if link else "missing",
                      "processes": len(nx.netns_pids(n.netns)) if n.netns in existing else 0})
    return {"name": name, "subnet": state.subnet, "bridge": state.bridge, "store_address": state.bridge_address,
            "host_hostname": state.host_hostname, "bridge_exists": state.bridge in host_links, "nodes": nodes}


def format_status(info: dict) -> str:
    lines = [f"test cluster {info['name']}: {len(info['nodes'])} node(s) on {info['subnet']}, bridge {info['bridge']}"
             f"{'' if info['bridge_exists'] else ' (MISSING)'}, host/store address {info['store_address']} "
             f"({info['host_hostname']})"]
    for n in info["nodes"]:
        lines.append(f"  node {n['node']}: {n['hostname']:<20} {n['address']:<15} netns {n['netns']}"
                     f"{'' if n['netns_exists'] else ' (MISSING)'}, link {n['link']}, {n['processes']} process(es)")
    return "\n".join(lines)


@dataclass
class TestCluster:
    """A handle on a running test cluster (what the pytest fixture yields). ``nodes``/``addresses``/
    ``hostnames`` are per node index; the fault methods record to the cluster's fault log like the CLI."""

    __test__ = False  # not a pytest test class, despite the name

    state: ClusterState

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def nodes(self) -> list[int]:
        return [n.index for n in self.state.nodes]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.state.nodes]

    @property
    def hostnames(self) -> list[str]:
        return [n.hostname for n in self.state.nodes]

    @property
    def netns(self) -> list[str]:
        return [n.netns for n in self.state.nodes]

    @property
    def store_address(self) -> str:
        return self.state.bridge_address

    def launch_overrides(self, launcher: str = "local") -> list[str]:
        """What to add to ``orch launch`` to run on this cluster (``launcher``: local or ray)."""
        return [f"launcher={launcher}", f"cluster.testcluster={self.name}"]

    def partition(self, node: int) -> dict:
        return partition(self.name, node)

    def heal(self, node: int) -> dict:
        return heal(self.name, node)

    def kill(self, node: int) -> dict:
        return kill(self.name, node)

    def pids(self, node: int) -> list[int]:
        return nx.netns_pids(self.state.nodes[node].netns)

    def run(self, node: int, *argv: str, check: bool = True):
        """Run a command on ``node`` (inside its namespace); returns the CompletedProcess."""
        return nx.in_netns(self.state.nodes[node].netns, *argv, check=check)

    def status(self) -> dict:
        return status(self.name)

    def down(self) -> dict:
        return down(self.name)

    @classmethod
    def up(cls, name: str, nodes: int) -> "TestCluster":
        return cls(up(name, nodes))

    @classmethod
    def attach(cls, name: str) -> "TestCluster":
        return cls(require_state(name))
