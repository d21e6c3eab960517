"""What a test cluster is, as its state file records it: pure data, no processes, no network.

``orch testcluster up`` writes ``<state dir>/<NAME>.json`` before it creates anything, so ``down`` (and the
next ``up`` of the same name) can remove whatever a crashed ``up`` left. Planning reads this file (through
``load_state``) to name each node's namespace, hostname and address; the plan itself stays pure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from orchestrator.errors import UserError

STATE_DIR_ENV = "ORCH_TESTCLUSTER_DIR"
DEFAULT_STATE_DIR = "/run/orch-testcluster"
NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,23}")
NODE_IFNAME = "eth0"
"""The node's interface inside its namespace (every node has its own eth0, as real hosts do)."""
SUBNET_PREFIX = "10.213"
"""Test clusters take a free ``10.213.S.0/24`` each; the address is only ever put on the cluster's own bridge."""
FIRST_NODE_HOST = 10
"""Node i gets ``10.213.S.(10 + i)``; ``.1`` is the bridge (the host namespace: store, launcher)."""
MAX_NODES = 200


def state_dir() -> Path:
    """Where state files live (``$ORCH_TESTCLUSTER_DIR``, default ``/run/orch-testcluster``)."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name or ""):
        raise UserError(f"test cluster name {name!r} is invalid. Fix: use 1-24 characters a-z, 0-9 and '-', "
                        "starting with a letter (e.g. --name ci)")
    return name


def link_tag(name: str) -> str:
    """A short tag for host-side link names, which Linux limits to 15 characters."""
    return hashlib.sha1(name.encode()).hexdigest()[:6]


@dataclass(frozen=True)
class NodeHost:
    """One test host: a network namespace with its own address, hostname and loopback."""

    index: int
    netns: str
    """``ip netns`` name; ``ip netns exec NETNS ...`` runs a command on this host."""
    hostname: str
    """Stable name, resolvable from every node (``/etc/netns/NETNS/hosts``), and the UTS hostname of the
    agents orch runs there."""
    address: str
    """IPv4 address on the cluster's bridge."""
    ifname: str
    """Interface name inside the namespace (``GLOO_SOCKET_IFNAME``)."""
    host_link: str
    """The host-side end of the node's veth pair (a bridge port): ``partition`` sets it down."""


@dataclass(frozen=True)
class ClusterState:
    """A test cluster: a bridge in the host namespace and ``nodes`` namespaces attached to it by veth pairs."""

    name: str
    subnet: str
    """``10.213.S.0/24``."""
    bridge: str
    """The bridge link in the host namespace."""
    bridge_address: str
    """The host namespace's address on the bridge: where the rendezvous store listens."""
    host_hostname: str
    """Name of the host namespace's address, resolvable from every node."""
    nodes: tuple[NodeHost, ...]
    created_t: float = 0.0

    @property
    def netns_names(self) -> list[str]:
        return [n.netns for n in self.nodes]

    def node(self, index: int) -> NodeHost:
        if not 0 <= index < len(self.nodes):
            raise UserError(f"node {index}: test cluster {self.name!r} has nodes 0..{len(self.nodes) - 1}. "
                            "Fix: pick one of them")
        return self.nodes[index]

    def hosts_file(self) -> str:
        """``/etc/hosts`` of every node: loopback, the host namespace, every node by name."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{self.bridge_address}\t{self.host_hostname}"]
        lines += [f"{n.address}\t{n.hostname}" for n in self.nodes]
        return "\n".join(lines + self.hosts_block().splitlines()[len(self.nodes) + 1:]) + "\n"

    def hosts_block(self) -> str:
        """The cluster's names for the host namespace's /etc/hosts (so lookups there never ask DNS). Each
        address appears twice: c10d's sockets are IPv6 and reverse-resolve ``::ffff:A.B.C.D``, which glibc
        does not match against the IPv4 line."""
        named = [(self.bridge_address, self.host_hostname)] + [(n.address, n.hostname) for n in self.nodes]
        return "\n".join([f"{a}\t{h}" for a, h in named] + [f"::ffff:{a}\t{h}" for a, h in named])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterState":
        nodes = tuple(NodeHost(**n) for n in data["nodes"])
        return cls(**{**data, "nodes": nodes})


def plan_cluster(name: str, nodes: int, subnet_index: int, created_t: float = 0.0) -> ClusterState:
    """The names and addresses of cluster ``name`` with ``nodes`` nodes on ``10.213.<subnet_index>.0/24``."""
    check_name(name)
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes {nodes}: a test cluster has 1 to {MAX_NODES} nodes. Fix: pick a number in range")
    tag, net = link_tag(name), f"{SUBNET_PREFIX}.{subnet_index}"
    hosts = tuple(NodeHost(index=i, netns=f"orch-{name}-node{i}", hostname=f"{name}-node{i}",
                           address=f"{net}.{FIRST_NODE_HOST + i}", ifname=NODE_IFNAME, host_link=f"ot{tag}n{i}")
                  for i in range(nodes))
    return ClusterState(name=name, subnet=f"{net}.0/24", bridge=f"ot{tag}br", bridge_address=f"{net}.1",
                        host_hostname=f"{name}-host", nodes=hosts, created_t=created_t)


def state_path(name: str) -> Path:
    return state_dir() / f"{check_name(name)}.json"


def faults_path(name: str) -> Path:
    """The cluster's fault log: one JSON line per partition, heal or kill (launchers read it)."""
    return state_dir() / f"{check_name(name)}.faults.jsonl"


def netns_re(name: str) -> re.Pattern:
    """The only namespace names cluster ``name`` ever creates: ``orch-NAME-node<N>``."""
    return re.compile(rf"orch-{re.escape(check_name(name))}-node(0|[1-9][0-9]{{0,2}})")


def link_re(name: str) -> re.Pattern:
    """The only host link names cluster ``name`` ever creates: ``ot<tag>br`` and ``ot<tag>n<N>``."""
    return re.compile(rf"ot{link_tag(check_name(name))}(br|n(0|[1-9][0-9]{{0,2}}))")


def validate_state(name: str, state: ClusterState, path: Path) -> ClusterState:
    """``state`` as read from ``path``, checked to name only what ``up`` of cluster ``name`` creates: its own
    name, namespaces ``orch-NAME-node<N>`` (so ``/etc/netns/<netns>`` stays under /etc/netns: no absolute
    name, no ``..``, no ``/``) and links ``ot<tag>...``. ``down`` deletes what the state names, so a state file
    that names anything else is refused (exit 2) before anything is touched."""
    def refuse(what: str) -> UserError:
        return UserError(f"test cluster state file {path} names {what}, which cluster {name!r} never creates: "
                         "refusing to remove or change anything. Fix: inspect that file; delete it by hand if it "
                         "is not orch's, then `orch testcluster down` removes only the cluster's own namespaces")

    if state.name != name:
        raise refuse(f"cluster {state.name!r}")
    own_ns, own_link = netns_re(name), link_re(name)
    for node in state.nodes:
        netns = node.netns if isinstance(node.netns, str) else repr(node.netns)
        if not own_ns.fullmatch(netns) or "/" in netns or ".." in netns:
            raise refuse(f"network namespace {netns!r} (path /etc/netns/{netns})")
        for link in (node.host_link,):
            if not isinstance(link, str) or not own_link.fullmatch(link):
                raise refuse(f"link {link!r}")
    if not isinstance(state.bridge, str) or not own_link.fullmatch(state.bridge):
        raise refuse(f"bridge {state.bridge!r}")
    return state


def hosts_backup_path(name: str) -> Path:
    """The host's /etc/hosts as it was before ``up`` of cluster ``name`` added its block; ``down`` deletes it
    once the block is removed (until then it is there to restore by hand)."""
    return state_dir() / f"{check_name(name)}.hosts.bak"


def load_state(name: str) -> Optional[ClusterState]:
    """The saved state of cluster ``name``, or None if no such cluster is up. Exit 2 when the file is
    malformed or names anything the cluster does not own (see :func:`validate_state`)."""
    path = state_path(name)
    if not path.exists():
        return None
    try:
        state = ClusterState.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"test cluster state file {path} is malformed ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())}). Fix: inspect it; delete it by hand if it is not "
                        "orch's") from None
    return validate_state(name, state, path)


def require_state(name: str) -> ClusterState:
    state = load_state(name)
    if state is None:
        raise UserError(f"no test cluster named {name!r} is up (no {state_path(name)}). "
                        f"Fix: sudo orch testcluster up --nodes N --name {name}")
    return state


def enter_argv(netns: str, hostname: str, argv: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``argv`` run on a test host: inside its network namespace (where ``/etc/netns/NETNS/hosts`` is the
    host's ``/etc/hosts``) and its own UTS namespace named ``hostname``. Every step execs, so the PID a
    launcher gets is the PID of ``argv`` itself."""
    return ("ip", "netns", "exec", netns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
            hostname, *argv)


def state_for_launch(name: Optional[str], max_nodes: int) -> Optional[ClusterState]:
    """The state of ``cluster.testcluster`` for a launch of ``max_nodes`` nodes (None when unset); exit 2 when
    the cluster is not up or has fewer hosts than the launch has nodes."""
    if not name:
        return None
    state = require_state(name)
    if len(state.nodes) < max_nodes:
        raise UserError(f"cluster.testcluster={name!r} has {len(state.nodes)} node(s) but the launch needs "
                        f"{max_nodes} (cluster.nnodes MAX). Fix: orch testcluster up --nodes {max_nodes} --name {name}, "
                        "or lower cluster.nnodes")
    return state
