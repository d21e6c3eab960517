"""``orch bench hang``: a worker that stops without dying, and a fault-free run watched for false alarms.

(a) A two-node job (preset cpu_elastic at 1..2 nodes, local launcher, a checkpoint every 5 steps) trains to
    step K; then node 1's worker gets SIGSTOP: its agent stays alive, so torchrun sees nothing, and without
    hang detection every rank would wait in the next all-reduce for ``backend.timeout_s`` (1800 s). orch's
    controller must name the rank, record its stack, end the node, and the job must recover and succeed.
    ``recovery_s``: the stop to the first step completed after the hang was detected (detection and the
    survivors' restart included).
(b) The same job without a fault for ``quiet_s`` seconds: every ``hang_detected`` there is a false alarm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from orchestrator.controller.hang_policy import read_beats
from orchestrator.errors import OrchError
from orchestrator.processes import terminate_tree
from orchestrator.rundir import EVENTS_FILE, HEARTBEATS_DIR, METRICS_FILE, EventName, read_jsonl

JOB = ["conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2", "trainer.log_every=1", "checkpoint.every_n_steps=5"]


def _launch(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "launch", *JOB, *overrides, f"run.dir={run_dir}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise OrchError(f"bench hang: the launch exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise OrchError(f"bench hang: timed out after {timeout_s:.0f} s waiting for {what}")


def _steps(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / METRICS_FILE)


def stopped_worker_drill(run_dir: Path, stop_at_step: int = 20, timeout_s: float = 300.0, max_steps: int = 200) -> dict:
    proc = _launch(run_dir, [f"trainer.max_steps={max_steps}"])
    try:
        _wait(lambda: any(m["step"] >= stop_at_step and m["world_size"] == 2 for m in _steps(run_dir)), 240,
              f"step {stop_at_step} at world size 2", proc)
        beat = _wait(lambda: [b for b in read_beats(run_dir / HEARTBEATS_DIR) if b.node == 1], 30,
                     "node 1's heartbeat", proc)[0]
        stopped_t = time.time()
        os.kill(beat.pid, signal.SIGSTOP)
        detected = _wait(lambda: [e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == EventName.HANG_DETECTED],
                         timeout_s, "the hang to be detected", proc)[0]
        # A step the survivors finish after the stop but before the detection was already in flight.
        _wait(lambda: [m for m in _steps(run_dir) if m["t"] > detected["t"]], timeout_s, "a step after the hang", proc)
        first_after = min(m["t"] for m in _steps(run_dir) if m["t"] > detected["t"])
        code = proc.wait(timeout=timeout_s)
    finally:
        terminate_tree(proc.pid, grace_s=10)
    events = read_jsonl(run_dir / EVENTS_FILE)
    hangs = [e for e in events if e["event"] == EventName.HANG_DETECTED]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {"detected": bool(hangs and hangs[0]["node"] == 1 and hangs[0]["pid"] == beat.pid and hangs[0]["stack"]),
            "detected_after_s": round(hangs[0]["t"] - stopped_t, 2) if hangs else None,
            "recovery_s": round(first_after - stopped_t, 2), "hang": hangs[0] if hangs else None,
            "exit_code": code, "status": summary.get("status"), "steps_completed": summary.get("steps_completed")}


def false_alarm_drill(run_dir: Path, quiet_s: float) -> dict:
    proc = _launch(run_dir, ["trainer.max_steps=1000000"])
    try:
        _wait(lambda: _steps(run_dir), 240, "the first step", proc)
        started = time.time()
        while time.time() - started < quiet_s:
            if proc.poll() is not None:
                raise OrchError(f"bench hang: the fault-free run exited with {proc.returncode}")
            time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        terminate_tree(proc.pid, grace_s=5)
    events = read_jsonl(run_dir / EVENTS_FILE)
    return {"false_alarms": sum(1 for e in events if e["event"] in (EventName.HANG_DETECTED, EventName.STRAGGLER)),
            "quiet_s": quiet_s, "steps": max((m["step"] for m in _steps(run_dir)), default=0)}


def run_hang_bench(quiet_s: float = 300.0, workdir: Optional[str] = None, max_steps: int = 200) -> dict:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="orch-bench-hang-") as tmp:
        base = Path(workdir or tmp)
        drill = stopped_worker_drill(base / "stopped", max_steps=max_steps)
        quiet = false_alarm_drill(base / "quiet", quiet_s)
    return {"detected": drill["detected"], "recovery_s": drill["recovery_s"], "false_alarms": quiet["false_alarms"],
            "detected_after_s": drill["detected_after_s"], "status": drill["status"],
            "steps_completed": drill["steps_completed"], "hang_rank": (drill["hang"] or {}).get("rank"),
            "hang_stack_head": ((drill["hang"] or {}).get("stack") or "")[:400], "quiet_s": quiet_s,
            "quiet_steps": quiet["steps"], "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def main_hang_bench(out: Optional[str], quiet_s: float) -> dict:
    r = run_hang_bench(quiet_s=quiet_s)
    print("a SIGSTOPped worker of a 2-node run (its agent alive), then a fault-free run")
    print(f"  detected: {r['detected']} (rank {r['hang_rank']}, {r['detected_after_s']} s after the stop)")
    print(f"  recovery: {r['recovery_s']} s from the stop to the next step (target <= 15 s; backend.timeout_s "
          f"would be 1800 s); run {r['status']} at {r['steps_completed']} steps")
    print(f"  false alarms over {r['quiet_s']:.0f} s fault-free: {r['false_alarms']} (target 0)")
    if out:
        Path(out).write_text(json.dumps(r, indent=2) + "\n")
    return r
