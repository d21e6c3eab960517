"""Fault injection against a running launch: the drills users run to watch recovery, and what tests use."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.report.runlog import EventLog

NODES_FILE = "nodes.json"  # written by launchers: {"<node>": <agent pid>}


def node_pids(run_dir: str) -> dict[int, int]:
    """The agent PID of every node of the launch in ``run_dir``."""
    path = Path(run_dir) / NODES_FILE
    if not path.exists():
        raise UserError(f"run dir {run_dir!r} has no {NODES_FILE}: it is not a running launch. "
                        "Fix: pass the run dir printed by `orch launch` while it runs")
    return {int(node): pid for node, pid in json.loads(path.read_text()).items()}


def kill_node(run_dir: str, node: int, sig: int = signal.SIGKILL) -> list[int]:
    """Kill simulated node ``node``: its torchrun agent and every worker under it. Logs ``chaos_kill``."""
    from launchers.processes import kill_tree

    pids = node_pids(run_dir)
    if node not in pids:
        raise UserError(f"--node {node}: run dir {run_dir!r} has nodes {sorted(pids)}. Fix: pick one of them")
    killed = kill_tree(pids[node], sig)
    if not killed:
        raise UserError(f"--node {node}: its agent (pid {pids[node]}) is not running. Fix: pick a live node")
    EventLog(run_dir).emit("chaos_kill", node=node, pids=killed, signal=signal.Signals(sig).name)
    return killed
