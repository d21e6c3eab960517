"""``orch testcluster up|down|status|partition|heal|kill``: argument parsing; the work is in ``cluster``."""

from __future__ import annotations

import argparse
import json

from orchestrator.errors import OrchError

DEFAULT_NAME = "orch"


def cmd_up(args: argparse.Namespace) -> int:
    from orchestrator.testcluster import cluster

    state = cluster.up(args.name, args.nodes)
    print(cluster.format_status(cluster.status(state.name)))
    print(f"run on it: orch launch conf=cpu_gloo launcher=local cluster.testcluster={state.name} "
          f"cluster.nnodes={len(state.nodes)}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator.testcluster import cluster

    removed = cluster.down(args.name)
    print(f"removed test cluster {args.name}: {len(removed['namespaces'])} namespace(s), {len(removed['links'])} "
          f"link(s), {len(removed['killed_pids'])} process(es) killed")
    if removed["left"]:
        raise OrchError(f"test cluster {args.name}: still there after down: {', '.join(removed['left'])}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.testcluster import cluster

    info = cluster.status(args.name)
    print(json.dumps(info, indent=2) if args.json else cluster.format_status(info))
    return 0


def cmd_fault(args: argparse.Namespace) -> int:
    from orchestrator.testcluster import cluster

    record = getattr(cluster, args.fault)(args.name, args.node)
    what = {"partition": "cut off (link down; its processes keep running)", "heal": "reconnected (link up)",
            "kill": f"killed: {len(record.get('pids', []))} process(es) {record.get('pids', [])}"}[args.fault]
    print(f"test cluster {args.name}: node {args.node} ({record['hostname']}) {what}")
    return 0


def add_testcluster_parser(sub) -> None:
    """Register ``orch testcluster ...`` on the top-level subparsers ``sub``."""
    tc = sub.add_parser("testcluster", help="multi-node test clusters on this machine: network namespaces, "
                        "real addresses, network faults (root)").add_subparsers(dest="testcluster_command", required=True)
    p = tc.add_parser("up", help="create N test hosts (network namespaces on a private bridge); replaces a "
                      "same-named cluster's leftovers")
    p.add_argument("--nodes", type=int, required=True, help="number of test hosts")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name (default {DEFAULT_NAME})")
    p.set_defaults(func=cmd_up)
    p = tc.add_parser("down", help="remove the cluster: processes inside, namespaces, links, bridge, state")
    p.add_argument("name", nargs="?", default=DEFAULT_NAME)
    p.set_defaults(func=cmd_down)
    p = tc.add_parser("status", help="nodes, addresses, link state and process counts")
    p.add_argument("name", nargs="?", default=DEFAULT_NAME)
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=cmd_status)
    for fault, text in (("partition", "cut NODE off the network (link down); its processes keep running"),
                        ("heal", "reconnect NODE (link up)"),
                        ("kill", "SIGKILL every process in NODE's namespace (a host crash)")):
        p = tc.add_parser(fault, help=text)
        p.add_argument("name")
        p.add_argument("node", type=int, help="node index (see status)")
        p.set_defaults(func=cmd_fault, fault=fault)
