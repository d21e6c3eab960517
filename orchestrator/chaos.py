"""Fault injection against a running launch: the drills users run to watch recovery, and what tests use.

Chaos acts only on what it owns: a signal goes to a PID only while the run dir's latest launch is still
running (no ``run_finished`` after its last ``launch_started``) and only when that PID is a torchrun agent
of THAT run (its argv runs ``torch.distributed.run`` and either names the run's rendezvous id or its
environment has ``ORCH_RUN_DIR`` set to this run dir). A PID reused by an unrelated process after the run
ended is never signalled.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any, Optional

from orchestrator.errors import UserError
from orchestrator.events import ChaosKill, ChaosPreempt
from orchestrator.preemption.notices import deliver_notice
# What the controller runs in torchrun's place when the store is gated, and the same in an interpreter the launch
# started ahead (its child).
from orchestrator.rendezvous.warm import AGENT_MODULE as TUNNEL_MODULE, WARM_MODULE
from orchestrator.rundir import NODES_FILE, EventLog, EventName, latest_launch

AGENT_MODULE = "torch.distributed.run"


def node_pids(run_dir: str) -> dict[int, int]:
    """The agent PID of every node of the launch in ``run_dir`` (exit 2 when nodes.json is absent or malformed)."""
    path = Path(run_dir) / NODES_FILE
    if not path.exists():
        raise UserError(f"run dir {run_dir!r} has no {NODES_FILE}: it is not a running launch. "
                        "Fix: pass the run dir printed by `orch launch` while it runs")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        pids = {int(node): pid for node, pid in data.items()}
        if not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pids.values()):
            raise ValueError("a PID is not a positive integer")
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is malformed ({' '.join(str(exc).split())}): expected {{\"<node>\": <agent pid>}}. "
                        "Fix: pass the run dir of a launch orch is running now; do not edit its nodes.json") from None
    return pids


def _require_running(run_dir: str) -> Optional[str]:
    """The run id of ``run_dir``'s latest launch (None if it recorded none); exit 2 when that launch finished."""
    events = latest_launch(EventLog(run_dir).read())
    finished = next((e for e in reversed(events) if e.get("event") == EventName.RUN_FINISHED), None)
    if finished is not None:
        raise UserError(f"run dir {run_dir!r}: its launch already finished ({finished.get('status', 'run_finished')}), "
                        f"so the PIDs in its {NODES_FILE} may belong to other processes now. "
                        "Fix: pass the run dir of a launch that is running now")
    started = events[0] if events and events[0].get("event") == EventName.LAUNCH_STARTED else None
    return str(started["run_id"]) if started and started.get("run_id") else None


def _own_rdzv_id(arg: str, run_id: str) -> bool:
    """``--rdzv-id=`` of the run: its id, a restart's ``<id>-<attempt>``, or a per_step replica group's
    ``<id>[-<attempt>]-node<N>-a<agent>``."""
    if not arg.startswith(f"--rdzv-id={run_id}"):
        return False
    rest = arg[len(f"--rdzv-id={run_id}"):]
    return re.fullmatch(r"(-\d+)?(-node\d+-a\d+)?", rest) is not None


def _agent_mismatch(pid: int, run_dir: str, run_id: Optional[str]) -> Optional[str]:
    """None when ``pid`` is a live torchrun agent of the run in ``run_dir``; else why not (for the message).

    Works for agents inside test-cluster namespaces too: those share this PID namespace (only the network and
    UTS namespaces differ), and ``enter_argv`` execs, so the PID in nodes.json is the agent itself."""
    import psutil

    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
    except psutil.NoSuchProcess:
        return "is not running"
    except psutil.AccessDenied:
        return "cannot be inspected (permission denied)"
    shown = " ".join(cmdline)[:80] or proc.name()
    if WARM_MODULE in cmdline:  # its command line came on its stdin: it is the run's if the run started it
        return None if _child_of_supervisor(proc, run_dir) else f"is a torchrun agent of another run ({shown!r})"
    if not {AGENT_MODULE, TUNNEL_MODULE} & set(cmdline):  # torchrun, or torchrun behind orch's store tunnel
        return f"is not a torchrun agent ({shown!r})"
    if run_id and any(_own_rdzv_id(a, run_id) for a in cmdline):
        return None
    try:
        env_dir = proc.environ().get("ORCH_RUN_DIR")
        cwd = proc.cwd() if env_dir and not os.path.isabs(env_dir) else "/"
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        env_dir = None
    if env_dir and os.path.realpath(os.path.join(cwd, env_dir)) == os.path.realpath(run_dir):
        return None
    return f"is a torchrun agent of another run ({shown!r})"


def _child_of_supervisor(proc: Any, run_dir: str) -> bool:
    """Whether ``proc``'s parent is the supervisor ``run_dir``'s launch record names (its PID and start time:
    a reused PID is not it)."""
    import psutil

    from orchestrator.launch_record import read_record

    supervisor = (read_record(run_dir) or {}).get("supervisor") or {}
    try:
        parent = proc.parent()
        return parent is not None and parent.pid == supervisor.get("pid") and \
            abs(parent.create_time() - float(supervisor.get("create_time", 0))) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _agent_pid(run_dir: str, node: int) -> int:
    """The PID of ``node``'s agent, checked: the launch is running and the PID is its agent (else exit 2)."""
    pids = node_pids(run_dir)
    if node not in pids:
        raise UserError(f"--node {node}: run dir {run_dir!r} has nodes {sorted(pids)}. Fix: pick one of them")
    run_id = _require_running(run_dir)
    why = _agent_mismatch(pids[node], run_dir, run_id)
    if why is not None:
        raise UserError(f"--node {node}: pid {pids[node]} in {run_dir}/{NODES_FILE} {why}, not this run's agent: "
                        "nothing was signalled. Fix: pick a live node of a running launch (see its nodes.json)")
    return pids[node]


def kill_node(run_dir: str, node: int, sig: int = signal.SIGKILL) -> list[int]:
    """Kill simulated node ``node``: its torchrun agent and every worker under it. Logs ``chaos_kill``. Exit 2
    (nothing signalled) unless the launch is running and the PID is its agent for ``node``."""
    from orchestrator.processes import kill_tree

    pid = _agent_pid(run_dir, node)
    killed = kill_tree(pid, sig)
    if not killed:
        raise UserError(f"--node {node}: its agent (pid {pid}) is not running. Fix: pick a live node")
    EventLog(run_dir).write(ChaosKill(node=node, pids=killed, signal=signal.Signals(sig).name))
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

    pid = _agent_pid(run_dir, node)
    t0 = time.time()
    deliver_notice(run_dir, node, pid, grace_s, source="chaos", detail=f"orch chaos preempt (grace {grace_s} s)")
    EventLog(run_dir).write(ChaosPreempt(node=node, grace_s=grace_s, agent_pid=pid))
    try:
        psutil.Process(pid).wait(timeout=grace_s)
        return {"node": node, "left_in_s": time.time() - t0}
    except psutil.NoSuchProcess:  # it left between the check and the wait
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
