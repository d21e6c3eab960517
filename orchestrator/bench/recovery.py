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
from orchestrator.rundir import METRICS_FILE, read_jsonl
from orchestrator.report.summary import build_summary

PRESET = "cpu_elastic"
JOB = ["cluster.nnodes=1:2", "trainer.max_steps=100000", "trainer.log_every=1", "checkpoint.every_n_steps=5"]
STEP_TIMEOUT_S = 180.0


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


def _bare_torchrun(run_dir: Path, kill_at_step: int, timeout_s: float) -> float:
    from orchestrator.config.compose import compose_config
    from orchestrator.launch import write_config
    from orchestrator.plan.plan import CONFIG_FILE, node_env

    cfg = compose_config(PRESET, [*JOB, "launcher=local", f"run.dir={run_dir}"])
    write_config(cfg, str(run_dir))
    port = _free_port()
    agents: dict[int, NodeProcess] = {}
    try:
        for node in (0, 1):
            argv = (sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.cluster.min_nodes}:{cfg.cluster.max_nodes}",
                    "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=bench-recovery", f"--max-restarts={cfg.cluster.max_restarts}",
                    "-m", "orchestrator.runtime.train", "--config", str(run_dir / CONFIG_FILE))
            agents[node] = NodeProcess(node, argv, node_env(cfg, node, str(run_dir), "bench-recovery"),
                                       run_dir / "logs" / f"node{node}.log", echo=None)
            if node == 0:  # node 0 hosts the store: let it bind the port before node 1 looks for it
                _wait_for(lambda: _port_open(port), 60, "bare torchrun's store on node 0")
        (run_dir / NODES_FILE).write_text(json.dumps({str(n): a.pid for n, a in agents.items()}) + "\n")
        return _kill_and_time(run_dir, kill_at_step, timeout_s, "bare torchrun")
    finally:
        for agent in agents.values():
            terminate_tree(agent.pid, grace_s=5)


def _orch(run_dir: Path, kill_at_step: int, timeout_s: float) -> float:
    log = run_dir.parent / "orch.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "launch", f"conf={PRESET}", *JOB,
                             "launcher=ray", f"run.dir={run_dir}"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
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
    _wait_for(lambda: (run_dir / NODES_FILE).exists() and "1" in json.loads((run_dir / NODES_FILE).read_text()),
              30, f"{who}'s node 1")
    kill_node(str(run_dir), 1)
    recoveries = _wait_for(lambda: build_summary(run_dir)["recoveries"], timeout_s, f"{who} to recover")
    return recoveries[0]["mttr_s"]


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


def main_recovery_bench(out: Optional[str], kill_at_step: int = 10) -> dict:
    """Run :func:`run_recovery_bench`, print both MTTRs and the ratio, write the result as JSON to ``out``."""
    r = run_recovery_bench(kill_at_step=kill_at_step)
    print(f"recovery after losing node 1 of 2 at step {r['kill_at_step']} (kill -> first completed step after it)")
    print(f"  bare torchrun (default rendezvous, store on node 0): {r['torchrun_mttr_s']:6.1f} s")
    print(f"  orch (Ray controller, store in the driver):          {r['orch_mttr_s']:6.1f} s")
    print(f"  orch/torchrun = {r['ratio']:.2f} (target <= 0.25, and orch under 10 s)")
    print(f"  load average (1 min) before/after: {r['load_avg_1m'][0]:.1f}/{r['load_avg_1m'][1]:.1f}")
    if out:
        Path(out).write_text(json.dumps(r, indent=2) + "\n")
    return r
