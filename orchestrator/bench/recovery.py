"""``orch bench recovery``: time to recover from losing a node, bare torchrun vs orch, side by side.

Both runs train the same tiny elastic job (preset cpu_elastic at 1..2 nodes, one process per node, a
checkpoint every 5 steps) and lose node 1 the same way once step K has completed: ``orch chaos kill-node``
(SIGKILL to its torchrun agent and worker). MTTR is read from each run dir by the same code
(``summary.recoveries``): the first completed training step after the kill, minus the kill.

(a) bare torchrun: two agents on this machine with torchrun's default rendezvous settings (no --rdzv-conf)
    and the c10d store on node 0 (is_host by default: node 0 starts first), which survives; only
    ``--max-restarts`` is set (to the preset's), as without it torchrun gives up at the first loss.
(b) orch: ``orch launch`` with the Ray launcher (embedded Ray): the store in the driver, orch's rendezvous
    timeouts, the controller's node agents.

``--mode per_step`` runs three nodes (1..3) and loses one of them, three ways in one run: bare torchrun, orch
in restart mode and orch in per_step mode (torchft: the survivors never restart). MTTR there ends at the
survivors' next committed step. ``lost_steps``: committed steps the job had to train again after the kill
(the last step it reached before the kill minus the step it went on from).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from orchestrator.processes import NodeProcess, terminate_tree
from orchestrator.chaos import kill_node
from orchestrator.rundir import NODES_FILE
from orchestrator.errors import OrchError
from orchestrator.rundir import METRICS_FILE, EventName, read_jsonl
from orchestrator.report.summary import build_summary

PRESET = "cpu_elastic"
JOB = ["cluster.nnodes=1:2", "trainer.max_steps=100000", "trainer.log_every=1", "checkpoint.every_n_steps=5"]
STEP_TIMEOUT_S = 180.0


MODES = ("restart", "per_step")


def run_modes_bench(kill_at_step: int = 20, recovery_timeout_s: float = 180.0, workdir: Optional[str] = None) -> dict:
    """Bare torchrun, orch restart and orch per_step, 1 of 3 nodes killed at step K in each; one object per mode
    (``orch_mttr_s``, ``torchrun_mttr_s``, ``ratio``, ``lost_steps``), the same bare torchrun in both."""
    load_before = os.getloadavg()[0]
    job = [*JOB, "cluster.nnodes=1:3"]
    with tempfile.TemporaryDirectory(prefix="orch-bench-recovery-") as tmp:
        base = Path(workdir or tmp)
        torchrun = _bare_torchrun(base / "torchrun", kill_at_step, recovery_timeout_s, nodes=3, job=job)
        result: dict = {}
        for mode in MODES:
            run_dir = base / mode
            mttr = _orch(run_dir, kill_at_step, recovery_timeout_s,
                         extra=[*job[len(JOB):], f"fault_tolerance.mode={mode}"], launcher="local")
            result[mode] = {"orch_mttr_s": mttr, "torchrun_mttr_s": torchrun, "ratio": round(mttr / torchrun, 3),
                            "lost_steps": lost_steps(run_dir)}
    result.update(nodes=3, kill_at_step=kill_at_step,
                  load_avg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)])
    return result


def lost_steps(run_dir: Path) -> int:
    """Steps reached before the kill that the job trained again: the highest step logged before it minus the
    step before the first one logged after it (metrics every step)."""
    events = read_jsonl(run_dir / "events.jsonl")
    kill_t = next(e["t"] for e in events if e["event"] == EventName.CHAOS_KILL)
    metrics = read_jsonl(run_dir / METRICS_FILE)
    before = max((m["step"] for m in metrics if m["t"] <= kill_t), default=0)
    after = min((m["step"] for m in metrics if m["t"] > kill_t), default=before + 1)
    return max(0, before - (after - 1))


def run_recovery_bench(kill_at_step: int = 10, recovery_timeout_s: float = 180.0, workdir: Optional[str] = None) -> dict:
    """MTTR of bare torchrun and of orch for the same kill; ``{"orch_mttr_s", "torchrun_mttr_s", "ratio"}``
    (ratio = orch / torchrun) plus the kill step. Run dirs go under ``workdir`` (kept) or a temporary dir."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="orch-bench-recovery-") as tmp:
        base = Path(workdir or tmp)
        torchrun = _bare_torchrun(base / "torchrun", kill_at_step, recovery_timeout_s)
        orch = _orch(base / "orch", kill_at_step, recovery_timeout_s)
    # The machine's load says how far to trust the seconds: both runs restart Python workers on shared cores.
    return {"orch_mttr_s": orch, "torchrun_mttr_s": torchrun, "ratio": round(orch / torchrun, 3),
            "kill_at_step": kill_at_step, "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _bare_torchrun(run_dir: Path, kill_at_step: int, timeout_s: float, nodes: int = 2,
                   job: Optional[list[str]] = None) -> float:
    from orchestrator.checkpoint.fence import RUN_ID_ENV
    from orchestrator.config.compose import compose_config
    from orchestrator.launch import write_config
    from orchestrator.plan.plan import CONFIG_FILE, node_env

    cfg = compose_config(PRESET, [*(job or JOB), "launcher=local", f"run.dir={run_dir}"])
    write_config(cfg, str(run_dir))
    port = _free_port()
    agents: dict[int, NodeProcess] = {}
    try:
        for node in range(nodes):
            argv = (sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.cluster.min_nodes}:{cfg.cluster.max_nodes}",
                    "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=bench-recovery", f"--max-restarts={cfg.cluster.max_restarts}",
                    "-m", "orchestrator.trainer.train", "--config", str(run_dir / CONFIG_FILE))
            # Bare torchrun has no orch launcher: no run id, so no lease fences its saves (nobody took one).
            env = {k: v for k, v in node_env(cfg, node, str(run_dir), "bench-recovery").items() if k != RUN_ID_ENV}
            agents[node] = NodeProcess(node, argv, env,
                                       run_dir / "logs" / f"node{node}.log", echo=None)
            if node == 0:  # node 0 hosts the store: let it bind the port before node 1 looks for it
                _wait_for(lambda: _port_open(port), 60, "bare torchrun's store on node 0")
        (run_dir / NODES_FILE).write_text(json.dumps({str(n): a.pid for n, a in agents.items()}) + "\n")
        return _kill_and_time(run_dir, kill_at_step, timeout_s, "bare torchrun")
    finally:
        for agent in agents.values():
            terminate_tree(agent.pid, grace_s=5)


def _orch(run_dir: Path, kill_at_step: int, timeout_s: float, extra: tuple = (), launcher: str = "ray") -> float:
    log = run_dir.parent / f"orch-{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "launch", f"conf={PRESET}", *JOB, *extra,
                             f"launcher={launcher}", f"run.dir={run_dir}"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _kill_and_time(run_dir, kill_at_step, timeout_s, "orch", proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # orch stops its agents and its embedded Ray
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        terminate_tree(proc.pid, grace_s=5)


def _kill_and_time(run_dir: Path, kill_at_step: int, timeout_s: float, who: str,
                   proc: Optional[subprocess.Popen] = None) -> float:
    def reached() -> bool:
        if proc is not None and proc.poll() is not None:
            raise OrchError(f"bench recovery: {who} exited with {proc.returncode} before step {kill_at_step} "
                            f"(see {run_dir.parent})")
        return any(m["step"] >= kill_at_step for m in read_jsonl(run_dir / METRICS_FILE))

    _wait_for(reached, STEP_TIMEOUT_S, f"{who} to reach step {kill_at_step}")
    _wait_for(lambda: (run_dir / NODES_FILE).exists() and "1" in json.loads((run_dir / NODES_FILE).read_text())
              and _all_replicas_in(run_dir),
              30, f"{who}'s node 1")
    kill_node(str(run_dir), 1)
    recoveries = _wait_for(lambda: build_summary(run_dir)["recoveries"], timeout_s, f"{who} to recover")
    return recoveries[0]["mttr_s"]


def _all_replicas_in(run_dir: Path) -> bool:
    """per_step: every node agent started is in the quorum (else the kill would hit a group still healing);
    restart mode has no quorum events and needs nothing more."""
    events = read_jsonl(run_dir / "events.jsonl")
    quorums = [e["replicas"] for e in events if e["event"] == EventName.QUORUM_CHANGED]
    if not quorums:
        return not any(e["event"] == EventName.REPLICA_HEALED for e in events)
    return quorums[-1] >= len(json.loads((run_dir / NODES_FILE).read_text()))


def _wait_for(predicate: Callable, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise OrchError(f"bench recovery: timed out after {timeout_s:.0f} s waiting for {what}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def main_recovery_bench(out: Optional[str], kill_at_step: int = 10, mode: str = "restart") -> dict:
    """Run :func:`run_recovery_bench` (``mode`` per_step: :func:`run_modes_bench`), print the MTTRs and ratios,
    write the result as JSON to ``out``."""
    if mode == "per_step":
        r = run_modes_bench(kill_at_step=max(kill_at_step, 20))
        print(f"recovery after losing 1 of 3 nodes at step {r['kill_at_step']} (kill -> next committed step)")
        print(f"  bare torchrun (default rendezvous, store on node 0): {r['restart']['torchrun_mttr_s']:6.2f} s")
        for m in MODES:
            print(f"  orch {m:<9} {r[m]['orch_mttr_s']:6.2f} s  ratio to torchrun {r[m]['ratio']:.3f}  "
                  f"lost steps {r[m]['lost_steps']}")
        print("  targets: per_step <= 0.5 s (the quorum drops a dead group when its agent exits, no heartbeat "
              "wait) and <= 0.05 x torchrun, 0 lost steps")
        print(f"  load average (1 min) before/after: {r['load_avg_1m'][0]:.1f}/{r['load_avg_1m'][1]:.1f}")
        if out:
            Path(out).write_text(json.dumps(r, indent=2) + "\n")
        return r
    r = run_recovery_bench(kill_at_step=kill_at_step)
    print(f"recovery after losing node 1 of 2 at step {r['kill_at_step']} (kill -> first completed step after it)")
    print(f"  bare torchrun (default rendezvous, store on node 0): {r['torchrun_mttr_s']:6.1f} s")
    print(f"  orch (Ray controller, store in the driver):          {r['orch_mttr_s']:6.1f} s")
    print(f"  orch/torchrun = {r['ratio']:.2f} (target <= 0.25, and orch under 10 s)")
    print(f"  load average (1 min) before/after: {r['load_avg_1m'][0]:.1f}/{r['load_avg_1m'][1]:.1f}")
    if out:
        Path(out).write_text(json.dumps(r, indent=2) + "\n")
    return r
