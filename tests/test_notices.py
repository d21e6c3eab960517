"""Notice files, and how a worker reads SIGTERM: a notice only when orch says so, torchrun restarting it otherwise.

The watcher tests (slow) send a real SIGTERM to a real child process that installs the watcher as a worker does;
the test process plays the child's torchrun agent (the child's parent), so notices go to ``node<N>-<test pid>``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.preemption import PREEMPTED_EXIT_CODE, AgentNotices, deliver_notice, read_notice
from orchestrator.preemption.notices import SIGTERM_NOTICE_ENV, Notice, notice_path, sigterm_notice_mode
from orchestrator.preemption.watcher import NO_RESTART_MESSAGE, RESTART_EXIT_CODE, RESTART_MESSAGE
from orchestrator.processes import kill_tree
from orchestrator.rundir import NOTICES_DIR
from orchproc import orch_env, wait_for

NODE = 1


# -- notice files -------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_deliver_writes_one_whole_notice_per_agent(tmp_path):
    before = time.time()
    path = deliver_notice(tmp_path, NODE, 4242, 20.0, "chaos", detail="a drill")
    assert path == tmp_path / NOTICES_DIR / "node1-4242.json" == notice_path(tmp_path, NODE, 4242)
    record = json.loads(path.read_text())
    assert {k: record[k] for k in ("grace_s", "node", "agent_pid", "source", "detail")} == {
        "grace_s": 20.0, "node": 1, "agent_pid": 4242, "source": "chaos", "detail": "a drill"}
    assert before <= record["t"] <= time.time()
    assert sorted(p.name for p in path.parent.iterdir()) == ["node1-4242.json"], "no temporary file left behind"
    notice = read_notice(tmp_path, NODE, 4242)
    assert (notice.source, notice.detail, notice.t, notice.grace_s) == ("chaos", "a drill", record["t"], 20.0)
    assert read_notice(tmp_path, NODE, 4243) is None, "another agent of the same node: a replacement"
    assert read_notice(tmp_path, 2, 4242) is None


@pytest.mark.timeout(30)
def test_a_sigterm_notice_replaces_a_chaos_one_and_is_never_replaced(tmp_path):
    deliver_notice(tmp_path, NODE, 7, 30.0, "chaos")
    deliver_notice(tmp_path, NODE, 7, 30.0, "sigterm", detail="orch got SIGTERM")
    assert read_notice(tmp_path, NODE, 7).source == "sigterm"  # the SIGTERM it announces must read as a notice
    deliver_notice(tmp_path, NODE, 7, 5.0, "chaos")
    assert read_notice(tmp_path, NODE, 7).source == "sigterm"


@pytest.mark.timeout(30)
def test_unreadable_or_foreign_notices_are_no_notice(tmp_path):
    path = notice_path(tmp_path, NODE, 9)
    path.parent.mkdir()
    path.write_text('{"t": 1.0, "gra')  # never what deliver_notice leaves, but a reader must not crash on it
    assert read_notice(tmp_path, NODE, 9) is None
    path.write_text(json.dumps({"t": 1.0, "grace_s": 5}))  # written before notices named their source
    assert read_notice(tmp_path, NODE, 9).source == "chaos"
    notices = AgentNotices(str(tmp_path), NODE, 9, frozenset({"sigterm"}))
    assert notices.read() is None, "chaos is not among this worker's sources"


@pytest.mark.timeout(30)
def test_hand_over_keeps_the_time_and_never_overwrites(tmp_path):
    notices = AgentNotices.of_parent(str(tmp_path), NODE, {"aws", "chaos"})
    assert notices.agent_pid == os.getppid()
    notices.hand_over(Notice("aws", "spot instance-action terminate", t=123.0))
    notices.hand_over(Notice("chaos", "later", t=456.0))
    assert notices.read() == Notice("aws", "spot instance-action terminate", 123.0, None)


@pytest.mark.timeout(30)
def test_sigterm_notice_mode_reads_the_plan_env():
    assert sigterm_notice_mode({}) == "always"
    assert sigterm_notice_mode({SIGTERM_NOTICE_ENV: "file"}) == "file"
    with pytest.raises(ValueError, match=f"{SIGTERM_NOTICE_ENV}='files' is invalid"):
        sigterm_notice_mode({SIGTERM_NOTICE_ENV: "files"})


@pytest.mark.timeout(60)
def test_the_plan_tells_every_node_to_read_sigterm_through_notice_files(tmp_path):
    from orchestrator.config.compose import compose_config
    from orchestrator.plan.plan import build_plan

    cfg = compose_config("cpu_elastic", ["launcher=local", "cluster.nnodes=1:2"])
    plan = build_plan(cfg, str(tmp_path), "run-x", store_port=1234)
    assert [n.env[SIGTERM_NOTICE_ENV] for n in plan.nodes] == ["file", "file"]


# -- the watcher in a real process ----------------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    # A worker as the trainer runs one: the watcher, then steps; at a boundary with a notice: save, leave 75.
    import json, os, sys, time

    from orchestrator.preemption import AgentNotices, PreemptionWatcher, sigterm_notice_mode
    from orchestrator.preemption.notices import Notice
    from orchestrator.preemption.sources import NoticeSource

    run_dir, node, sources = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    step_s, peer_notice_at = float(os.environ.get("STEP_S", "0.05")), int(os.environ.get("PEER_NOTICE_AT", "0"))
    defer, peer_restart_at = bool(os.environ.get("DEFER")), int(os.environ.get("PEER_RESTART_AT", "0"))

    class AnnouncesOnce(NoticeSource):  # a cloud metadata service that says it once (as GCP's long-poll may)
        name = "aws"
        said = False

        def poll(self):
            if self.said:
                return None
            self.said = True
            return Notice("aws", "spot instance-action terminate", t=123.0)

    pollers = [AnnouncesOnce()] if os.environ.get("ANNOUNCE") else []
    mode = sigterm_notice_mode() if "sigterm" in sources else None
    notices = AgentNotices.of_parent(run_dir, node, set(sources))
    watcher = PreemptionWatcher(pollers, mode, 0.05, notices, defer_restart=defer).start()
    print("ready", flush=True)
    step, deadline = 0, time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(step_s)  # a training step
        step += 1
        if watcher.notice is not None or step == peer_notice_at:
            watcher.mark_acting()
            n = watcher.notice
            print(json.dumps({"acting": step, "source": n and n.source, "t": n and n.t}), flush=True)
            time.sleep(1.0)  # the emergency checkpoint
            print("saved", flush=True)
            os._exit(75)
        if defer and (watcher.restart_requested or step == peer_restart_at):  # what the ranks agreed on
            print(f"restart agreed at step {step}", flush=True)
            watcher.leave_for_restart(float(os.environ.get("WAIT_S", "20")))
    print("no notice", flush=True)
""")


class Worker:
    """One child worker, its output in files; ``finish`` ends it by PID if it is still there."""

    def __init__(self, tmp_path: Path, name: str, sources: str, env: dict[str, str]):
        script = tmp_path / "worker.py"
        if not script.exists():
            script.write_text(WORKER)
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        self.proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(NODE), sources],
                                     stdout=self.out.open("w"), stderr=self.err.open("w"),
                                     env=orch_env(env), start_new_session=True)
        wait_for(lambda: "ready" in self.out.read_text() or self.proc.poll() is not None, 30, f"{name} to start")
        assert "ready" in self.out.read_text(), self.err.read_text()

    def sigterm_and_wait(self, timeout: float = 10.0) -> tuple[int, float]:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout), time.monotonic() - start

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def acted(self) -> dict:
        (line,) = [json.loads(x) for x in self.lines() if x.startswith("{")]
        return line

    def finish(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait(timeout=10)


FILE_MODE = {SIGTERM_NOTICE_ENV: "file"}
BARE = {SIGTERM_NOTICE_ENV: ""}  # a bare torchrun: nothing set it


@pytest.fixture
def workers(tmp_path):
    started: list[Worker] = []

    def start(name: str, sources: str = "sigterm,chaos", env: dict[str, str] = FILE_MODE) -> Worker:
        started.append(Worker(tmp_path, name, sources, env))
        return started[-1]

    yield start
    for worker in started:
        worker.finish()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_orch_a_sigterm_without_notice_is_a_restart_the_worker_leaves_at_once(workers):
    worker = workers("w")
    code, took = worker.sigterm_and_wait()
    assert code == RESTART_EXIT_CODE and took < 2.0
    assert worker.lines() == ["ready"], "no checkpoint, no notice"
    assert RESTART_MESSAGE.decode().strip() in worker.err.read_text()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_worker_that_agrees_at_step_boundaries_leaves_for_a_restart_at_the_next_one(workers):
    worker = workers("w", env={**FILE_MODE, "DEFER": "1", "STEP_S": "0.3"})
    code, took = worker.sigterm_and_wait()
    assert code == RESTART_EXIT_CODE and took < 2.0
    assert worker.lines()[-1].startswith("restart agreed at step"), "it finished its step: no broken collective"
    assert RESTART_MESSAGE.decode().strip() in worker.err.read_text()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_after_a_peers_restart_a_worker_leaves_on_its_own_agents_sigterm(workers):
    worker = workers("w", env={**FILE_MODE, "DEFER": "1", "PEER_RESTART_AT": "3"})
    wait_for(lambda: worker.lines()[-1].startswith("restart agreed"), 20, "the ranks to agree on a restart")
    time.sleep(0.5)  # its agent is a monitor tick late
    assert worker.proc.poll() is None, "it waits for its own agent's SIGTERM"
    code, took = worker.sigterm_and_wait()
    assert code == RESTART_EXIT_CODE and took < 2.0
    assert RESTART_MESSAGE.decode().strip() in worker.err.read_text()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_after_a_peers_restart_a_worker_whose_agent_stays_leaves_after_the_wait(workers):
    worker = workers("w", env={**FILE_MODE, "DEFER": "1", "PEER_RESTART_AT": "3", "WAIT_S": "1"})
    assert worker.proc.wait(timeout=20) == RESTART_EXIT_CODE
    assert NO_RESTART_MESSAGE.decode().strip() in worker.err.read_text()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_orch_a_sigterm_announced_by_a_notice_file_is_a_notice(tmp_path, workers):
    worker = workers("w")
    deliver_notice(tmp_path, NODE, os.getpid(), 30.0, "sigterm", detail="orch got SIGTERM")
    code, _ = worker.sigterm_and_wait()
    assert code == PREEMPTED_EXIT_CODE and worker.lines()[-1] == "saved"
    assert worker.acted()["source"] == "sigterm"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_another_agents_notice_does_not_make_a_sigterm_a_notice(tmp_path, workers):
    worker = workers("w")
    deliver_notice(tmp_path, NODE, 999_999_999, 30.0, "sigterm")  # a replaced agent of the same node
    deliver_notice(tmp_path, NODE + 1, os.getpid(), 30.0, "sigterm")  # another node
    code, _ = worker.sigterm_and_wait()
    assert code == RESTART_EXIT_CODE and worker.lines() == ["ready"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_bare_torchrun_worker_takes_every_sigterm_as_a_notice(workers):
    worker = workers("w", env=BARE)
    code, _ = worker.sigterm_and_wait()
    assert code == PREEMPTED_EXIT_CODE and worker.acted()["source"] == "sigterm"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_worker_saving_on_a_notice_finishes_the_save_despite_a_restart_sigterm(workers):
    worker = workers("w", env={**FILE_MODE, "PEER_NOTICE_AT": "3"})
    wait_for(lambda: any(x.startswith("{") for x in worker.lines()), 20, "the worker to act on a peer's notice")
    code, _ = worker.sigterm_and_wait()
    assert code == PREEMPTED_EXIT_CODE and worker.lines()[-1] == "saved"


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("env", [FILE_MODE, BARE])
def test_a_notice_given_between_rounds_is_acted_on_by_the_next_workers(tmp_path, workers, env):
    """torchrun restarted the workers after the notice came: the new ones read it at start-up."""
    notice = deliver_notice(tmp_path, NODE, os.getpid(), 30.0, "chaos", detail="orch chaos preempt (grace 30.0 s)")
    worker = workers("next", env={**env, "STEP_S": "0.5"})  # too slow a step for the poller to be what saw it
    assert worker.proc.wait(timeout=20) == PREEMPTED_EXIT_CODE
    acted = worker.acted()
    assert acted["acting"] == 1 and acted["source"] == "chaos"
    assert acted["t"] == json.loads(notice.read_text())["t"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_polled_notice_outlives_a_restart_before_the_step_boundary(tmp_path, workers):
    """A cloud notice seen mid-step, then torchrun restarts the workers: the next ones still act on it."""
    first = workers("first", sources="sigterm,aws", env={**FILE_MODE, "STEP_S": "20", "ANNOUNCE": "1"})
    wait_for(lambda: read_notice(tmp_path, NODE, os.getpid()), 10, "the polled notice to be handed over")
    assert first.sigterm_and_wait()[0] == RESTART_EXIT_CODE and first.lines() == ["ready"]
    second = workers("second", sources="sigterm,aws", env=FILE_MODE)  # its cloud says nothing more
    assert second.proc.wait(timeout=20) == PREEMPTED_EXIT_CODE
    assert second.acted() == {"acting": 1, "source": "aws", "t": 123.0}
