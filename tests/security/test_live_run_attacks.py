"""Every port of a live per_step run, attacked from this host without the run's secret: for each TCP socket the
run's process tree listens on, torch's TCPStore client writes no key, an HTTP ``POST /replica/x/kill`` is
refused, a raw pickle runs nothing; no socket listens on every interface; and the run finishes normally.

One launch (``conf=cpu_elastic launcher=local cluster.nnodes=1:2 fault_tolerance.mode=per_step``), attacked
once both replica groups train.
"""

from __future__ import annotations

import http.client
import socket
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from orchproc import read_jsonl, start_orch, stop_tree, summary, wait_for
from security.attackers import stranger_writes_many, touching_pickle, touching_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
pytest.importorskip("torchft")

MAX_STEPS = 400
SECRET = "live-run-secret-" + "5e" * 16  # given to the driver, to look for it in everything the run wrote


def listening_sockets(root_pid: int) -> dict[tuple[str, int], str]:
    """(address, port) -> the command of the process of ``root_pid``'s tree that listens there."""
    found: dict[tuple[str, int], str] = {}
    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp")
            name = " ".join(proc.cmdline()[:4])
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found[(c.laddr.ip, c.laddr.port)] = name
    return found


def http_kill(host: str, port: int) -> str:
    """POST /replica/x/kill as torchft's dashboard takes it; the status line, or why there was none."""
    host = f"[{host}]" if ":" in host else host
    request = urllib.request.Request(f"http://{host}:{port}/replica/x/kill", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError, http.client.HTTPException) as exc:  # not HTTP at all: orch's greeting, or a hang-up
        return f"no HTTP ({type(exc).__name__})"


def send_raw(host: str, port: int, data: bytes) -> None:
    try:
        with socket.create_connection((host, port), timeout=3) as sock:
            sock.sendall(data)
            sock.settimeout(3)
            sock.recv(1024)
    except OSError:
        pass


def test_no_port_of_a_live_per_step_run_admits_a_stranger_and_the_run_finishes(tmp_path: Path):
    run_dir, marker = tmp_path / "run", tmp_path / "PAYLOAD-RAN"
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2",
                      "fault_tolerance.mode=per_step", f"trainer.max_steps={MAX_STEPS}", "trainer.log_every=5",
                      "checkpoint.every_n_steps=100", f"run.dir={run_dir}", log=tmp_path / "orch.log",
                      env={"ORCH_RUN_SECRET": SECRET})
    try:
        wait_for(lambda: [e for e in read_jsonl(run_dir / "events.jsonl")
                          if e["event"] == "quorum_changed" and e.get("replicas") == 2], 240, "both groups training")
        ports = listening_sockets(proc.pid)
        assert len(ports) >= 5, ports  # the gate, two relays per agent, the peer state servers, gloo's own
        everywhere = [p for p in ports if p[0] in ("0.0.0.0", "::")]
        assert not everywhere, f"listening on every interface: {[(p, ports[p]) for p in everywhere]}"
        rdzv_id = next(e["rdzv_id"] for e in read_jsonl(run_dir / "events.jsonl") if e.get("rdzv_id"))
        targets = [(host, port, key, touching_state(marker)) for host, port in ports
                   for key in ("orch-attack", f"torch.rendezvous.{rdzv_id}")]
        for (host, port, key, _), verdict in zip(targets, stranger_writes_many(targets)):
            assert verdict.startswith("REFUSED"), f"{ports[(host, port)]} on {host}:{port} let a stranger write {key}"
        for (host, port), owner in ports.items():
            kill = http_kill(host, port)
            assert not kill.startswith("HTTP 2"), f"{owner} on {host}:{port} took a kill request: {kill}"
            send_raw(host, port, touching_pickle(marker))
        assert proc.wait(timeout=300) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    assert not marker.exists(), "a payload ran"
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == MAX_STEPS, s
    events = read_jsonl(run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] in ("worker_failed", "restart")], "the attacks broke nothing"
    refused = [e for e in events if e["event"] == "store_client_refused"]
    assert {e.get("port") for e in refused} >= {"store", "agent relay"}, refused[:5]
    written = [p for p in [tmp_path / "orch.log", *run_dir.rglob("*")] if p.is_file()]
    leaked = [p for p in written if SECRET.encode() in p.read_bytes()]
    assert not leaked, f"the run's secret is in {leaked}"
