"""Fault injection against a running launch: the drills users run to watch recovery, and what tests use."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.preemption.notices import deliver_notice
from orchestrator.rundir import NODES_FILE, EventLog, EventName


def node_pids(run_dir: str) -> dict[int, int]:
    """The agent PID of every node of the launch in ``run_dir``."""
    path = Path(run_dir) / NODES_FILE
    if not path.exists():
        raise UserError(f"run dir {run_dir!r} has no {NODES_FILE}: it is not a running launch. "
                        "Fix: pass the run dir printed by `orch launch` while it runs")
    return {int(node): pid for node, pid in json.loads(path.read_text()).items()}


def kill_node(run_dir: str, node: int, sig: int = signal.SIGKILL) -> list[int]:
    """Kill simulated node ``node``: its torchrun agent and every worker under it. Logs ``chaos_kill``."""
    from orchestrator.processes import kill_tree

    pids = node_pids(run_dir)
    if node not in pids:
        raise UserError(f"--node {node}: run dir {run_dir!r} has nodes {sorted(pids)}. Fix: pick one of them")
    killed = kill_tree(pids[node], sig)
    if not killed:
        raise UserError(f"--node {node}: its agent (pid {pids[node]}) is not running. Fix: pick a live node")
    EventLog(run_dir).emit(EventName.CHAOS_KILL, node=node, pids=killed, signal=signal.Signals(sig).name)
    return killed


def preempt_node(run_dir: str, node: int, grace_s: float = 30.0) -> dict:
    """Deliver a preemption notice to ``node`` (the ``chaos`` source: its agent's notice file, see
    orchestrator/preemption/notices.py), then kill it after ``grace_s`` seconds if it is still alive, as a
    cloud takes the machine at its deadline. Returns what happened: ``{"node", "left_in_s"}`` or
    ``{"node", "killed_pids"}``.

    The notice is kept for the agent's life: workers training now see it within a poll interval, and workers
    that torchrun starts later (a notice that came between two rounds) read it at start-up and act on it at
    their first step boundary, all within the same grace."""
    import time

    import psutil

    pid = node_pids(run_dir).get(node)
    if pid is None or not psutil.pid_exists(pid):
        raise UserError(f"--node {node}: run dir {run_dir!r} has no live agent for it. Fix: pick a live node "
                        f"(nodes.json lists {sorted(node_pids(run_dir))})")
    t0 = time.time()
    deliver_notice(run_dir, node, pid, grace_s, source="chaos", detail=f"orch chaos preempt (grace {grace_s} s)")
    EventLog(run_dir).emit(EventName.CHAOS_PREEMPT, node=node, grace_s=grace_s, agent_pid=pid)
    proc = psutil.Process(pid)
    try:
        proc.wait(timeout=grace_s)
        return {"node": node, "left_in_s": time.time() - t0}
    except psutil.TimeoutExpired:
        return {"node": node, "killed_pids": kill_node(run_dir, node)}


class PreemptionDrill:
    """``preemption.schedule``: every ``every_s`` seconds, preempt a node (a random live one by default)."""

    def __init__(self, run_dir: str, schedule):
        import threading

        self.run_dir, self.schedule = run_dir, schedule
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orch-preemption-drill", daemon=True)

    def start(self) -> None:
        if self.schedule.every_s:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        import random

        import psutil

        count = 0
        while not self._stop.wait(self.schedule.every_s):
            if self.schedule.max_count is not None and count >= self.schedule.max_count:
                return
            live = [n for n, pid in node_pids(self.run_dir).items() if psutil.pid_exists(pid)]
            node = self.schedule.node if self.schedule.node is not None else (random.choice(live) if live else None)
            if node is None or node not in live:
                continue
            try:
                preempt_node(self.run_dir, node, self.schedule.grace_s)
                count += 1
            except UserError:
                continue  # the node left on its own meanwhile
