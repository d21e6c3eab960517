"""Every bad input of issues #14 and #23 exits 2 with one line (key, value, fix) and leaves nothing behind; and
docs/reliability.md's table holds exactly the message each one gets.

Each case runs the real CLI entry (``orchestrator.cli.main``) in this process, in an empty working directory,
once (a module fixture): the per-case test and the table test both read that outcome. The cases of issue #23 also run
as the ``orch`` command in a process of its own (slow). ``python tests/test_bad_inputs.py`` prints the table
rows for the docs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
LAUNCH = ["launch", "conf=cpu_gloo", "launcher=local", "run.dir=TMP/run"]


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    setup: Callable[[Path], object] = lambda tmp: None


def _bad_manifest(tmp: Path) -> None:
    step = tmp / "ckpt" / "step_000000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "step": 1, "created_t": 1e20, "files": {}, "metadata": {}}))


def _events(content: bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "rd").mkdir()
        (tmp / "rd" / "events.jsonl").write_bytes(content)
    return setup


def _nodes_json(tmp: Path) -> None:
    (tmp / "rd").mkdir()
    (tmp / "rd" / "nodes.json").write_text('{"0": "abc"')


def _busy_port(tmp: Path) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _live_lease(tmp: Path):
    from orchestrator.checkpoint.lease import Lease

    lease = Lease(str(tmp / "run"), "first-run", 60.0, "run.dir")
    lease.acquire()  # held by this (live) process: a second launch there must be refused
    return lease


CASES = [
    Case("override without a key", (*LAUNCH, "=5")),
    Case("group set to a number", (*LAUNCH, "backend=5")),
    Case("infinite grace period", (*LAUNCH, "preemption.grace_period_s=inf")),
    Case("10000 nodes", (*LAUNCH, "cluster.nnodes=1:10000")),
    Case("run dir that cannot be created", (*LAUNCH[:3], "run.dir=/proc/x")),
    Case("busy store port", (*LAUNCH, "rendezvous.port=PORT"), _busy_port),
    Case("k8s render -o a file", ("k8s", "render", "conf=cpu_gloo", "checkpoint.url=s3://b/x", "-o", "TMP/file"),
         lambda tmp: (tmp / "file").touch()),
    Case("store port out of range", ("rendezvous-store", "--port", "99999")),
    Case("manifest created_t 1e20", ("ckpt", "inspect", "TMP/ckpt"), _bad_manifest),
    Case('events line without "event"', ("report", "TMP/rd"), _events(b'{"t": 1}\n')),
    Case("events line with binary bytes", ("report", "TMP/rd"), _events(b'\xff\xfe{"t":1,"event":"x"}\n')),
    Case("malformed nodes.json", ("chaos", "kill-node", "TMP/rd", "--node", "0"), _nodes_json),
    Case("script that does not exist", (*LAUNCH, "entrypoint.script=/nonexistent.py")),
    Case("module that does not exist", (*LAUNCH, "entrypoint.module=no.such")),
    Case("resume from a step never saved", (*LAUNCH, "checkpoint.resume=99")),
    Case("memory:// with several ranks", (*LAUNCH, "checkpoint.url=memory://ckpt")),
    Case("infinite collective timeout", (*LAUNCH, "backend.timeout_s=inf")),
    Case("empty run.dir", (*LAUNCH[:3], "run.dir=")),
    Case("empty entrypoint.script", (*LAUNCH, "entrypoint.script=")),
    Case("empty checkpoint.url", (*LAUNCH, "checkpoint.url=")),
    Case("run dir of a live run", (*LAUNCH,), _live_lease),
    # issue #23: hosts, numbers, names, the k8s output directory and credentials in rendered URLs
    Case("store host that is no address", (*LAUNCH, "rendezvous.host=999.1.1.1")),
    Case("empty store host", (*LAUNCH, "rendezvous.host=")),
    Case("store host that does not resolve", (*LAUNCH, "rendezvous.host=no-such-host.invalid")),
    Case("store host of another machine", (*LAUNCH, "rendezvous.host=192.0.2.1")),
    Case("empty Ray address", (*LAUNCH, "cluster.address=")),
    Case("Ray address that is no address", (*LAUNCH, "cluster.address=999.1.1.1:6379")),
    Case("metadata endpoint without a host", (*LAUNCH, "preemption.aws_endpoint=http://")),
    Case("learning rate that is not a number", (*LAUNCH, "optim.lr=abc")),
    Case("negative learning rate", (*LAUNCH, "optim.lr=-0.1")),
    Case("infinite learning rate", (*LAUNCH, "optim.lr=inf")),
    Case("warmup steps that are not a number", (*LAUNCH, "scheduler.warmup_steps=abc")),
    Case("optimizer that refuses its arguments", (*LAUNCH, "optim=sgd", "optim.momentum=0", "+optim.nesterov=true")),
    Case("max_steps beyond 2^63", (*LAUNCH, "trainer.max_steps=99999999999999999999999")),
    Case("join timeout of 300 years", (*LAUNCH, "rendezvous.join_timeout_s=9999999999")),
    Case("run.id with a path", (*LAUNCH, "run.id=../evil")),
    Case("run.id with capitals", (*LAUNCH, "run.id=Exp_1")),
    Case("preset name with a path", (*LAUNCH, "preset=../x")),
    Case("k8s render -o unwritable", ("k8s", "render", "conf=cpu_gloo", "checkpoint.url=s3://b/x", "-o", "/proc/nope")),
    Case("k8s render credential in checkpoint.url", ("k8s", "render", "conf=cpu_gloo",
                                                     "checkpoint.url=s3://AKIAEXAMPLE:hunter2hunter2@bucket/x", "-o", "TMP/out")),
    Case("k8s render credential in k8s.env", ("k8s", "render", "conf=cpu_gloo", "checkpoint.url=s3://b/x",
                                              "+k8s.env.DB_URL=postgres://user:hunter3@h/db", "-o", "TMP/out")),
]
ISSUE_23 = [c for c in CASES if c.name == "store host that is no address" or CASES.index(c) > CASES.index(
    next(c for c in CASES if c.name == "store host that is no address"))]
CREDENTIALS = ("hunter2hunter2", "hunter3")  # the passwords of the two credential cases: never printed


def run_case(case: Case, tmp: Path) -> tuple[int, str, str]:
    """Run ``case`` in ``tmp``; returns (exit code, stderr, stderr with tmp and port replaced by TMP and PORT)."""
    from orchestrator.cli import main

    held = case.setup(tmp)
    port = str(held.getsockname()[1]) if isinstance(held, socket.socket) else None
    argv = [a.replace("TMP", str(tmp)).replace("PORT", port or "PORT") for a in case.argv]
    before, out, err_stream = os.getcwd(), io.StringIO(), io.StringIO()
    os.chdir(tmp)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err_stream):
            code = main(argv)
    finally:
        os.chdir(before)
        if held is not None:
            (held.close if isinstance(held, socket.socket) else held.release)()
    err = err_stream.getvalue()
    shown = err.replace(str(tmp), "TMP")
    if port:
        shown = shown.replace(port, "PORT")
    shown = re.sub(r"\(pid \d+ on \S+, heartbeat \d+ s ago\)", "(pid PID on HOST, heartbeat N s ago)", shown)
    return code, err, shown


@dataclass(frozen=True)
class Outcome:
    """What one case did: its exit code, its stderr as printed and as the table shows it, and the paths in its
    directory before and after (the live lease's run dir listed apart: the lease is released since); or the
    traceback of what it raised instead."""
    code: int = 0
    err: str = ""
    shown: str = ""
    before: tuple[Path, ...] = ()
    after: tuple[Path, ...] = ()
    live_run_dir: tuple[Path, ...] = ()
    raised: str = ""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every case, run once in a directory of its own."""
    done = {}
    for case in CASES:
        tmp = tmp_path_factory.mktemp("case")
        before = tuple(sorted(p.relative_to(tmp) for p in tmp.rglob("*")))
        try:
            code, err, shown = run_case(case, tmp)
        except Exception:  # a bug: that case's test fails with it, the others still run
            done[case.name] = Outcome(raised=traceback.format_exc())
            continue
        after = tuple(sorted(p.relative_to(tmp) for p in tmp.rglob("*")))
        live = tuple((tmp / "run").iterdir()) if case.setup is _live_lease else ()
        done[case.name] = Outcome(code, err, shown, before, after, live)
    return done


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, outcomes):
    outcome = outcomes[case.name]
    assert not outcome.raised, outcome.raised
    code, err = outcome.code, outcome.err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("orch: error: ") and "Fix:" in err, err
    if case.setup is _live_lease:  # the live run's dir keeps only its lease: no config.yaml of the refused launch
        assert outcome.live_run_dir == ()  # the lease, released since; no config.yaml
        return
    before, after = outcome.before, outcome.after
    setup_files = {p for p in after if p in before} | {Path("file"), Path("rd"), Path("ckpt")}
    assert [p for p in after if not any(p == s or s in p.parents for s in setup_files)] == [], "something was written"


def orch_command() -> list[str]:
    """The installed ``orch`` script beside this interpreter, or the same entry point as a module."""
    script = Path(sys.executable).with_name("orch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "orchestrator.cli"]


COMMANDS_AT_ONCE = 3  # each is a fresh interpreter importing torch: CPU-bound, so a few at a time


@pytest.fixture(scope="module")
def orch_commands(tmp_path_factory):
    """Every issue-#23 case as the ``orch`` command, each in a process and an empty directory of its own, queued
    together when the first test asks and run a few at a time; each test waits for its own case's result
    (argv, directory, completed process), so one test's wait overlaps the next cases' runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def run(case: Case, tmp: Path):
        argv = [a.replace("TMP", str(tmp)) for a in case.argv]
        return argv, tmp, subprocess.run([*orch_command(), *argv], cwd=tmp, capture_output=True, text=True,
                                         timeout=100, env=env)

    with ThreadPoolExecutor(max_workers=COMMANDS_AT_ONCE) as pool:
        futures = {case.name: pool.submit(run, case, tmp_path_factory.mktemp("orch-command")) for case in ISSUE_23}
        yield futures
        for future in futures.values():  # a case whose test did not run (-k, -x): never started
            future.cancel()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ISSUE_23, ids=[c.name for c in ISSUE_23])
def test_the_orch_command_exits_2_with_one_line_and_no_traceback(case, orch_commands):
    """As a user meets it: the ``orch`` command in a process of its own, nothing left in its directory."""
    argv, tmp_path, done = orch_commands[case.name].result(timeout=110)
    assert done.returncode == 2, (done.stdout, done.stderr)
    # stdout: nothing, or a launch's first line (what it is doing, printed before any check: issue 27)
    assert done.stdout == "" or (done.stdout.startswith(f"[orch] {argv[0]} ") and done.stdout.count("\n") == 1), \
        done.stdout
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("orch: error: ") and "Fix:" in done.stderr, done.stderr
    overrides = [a.lstrip("+").split("=", 1)[0] for a in argv if "=" in a]
    key = "-o" if "/proc/nope" in argv else overrides[-1]  # the bad one is the last override of every case
    # the key, or its group where the optimizer refuses the combination (optim='torch.optim.SGD' refuses ...)
    assert done.stderr.startswith((f"orch: error: {key}=", f"orch: error: {key.split('.')[0]}=")), done.stderr
    assert not any(secret in done.stderr for secret in CREDENTIALS)
    assert list(tmp_path.iterdir()) == [], "something was written"
    assert not Path("/proc/nope").exists()


@pytest.mark.parametrize("check, value", [("run_id", "cpu-gloo-1\n"), ("host", "localhost\n"), ("dns", "team-a\n")])
def test_a_trailing_newline_is_no_way_past_a_name_check(check, value):
    """``$`` in a pattern matches before a final newline: the name checks match the whole value."""
    from orchestrator.config.k8s_checks import check_dns_name
    from orchestrator.config.values import check_host, check_run_id
    from orchestrator.errors import ConfigError

    run = {"run_id": lambda: check_run_id(value), "host": lambda: check_host("rendezvous.host", value, "fix"),
           "dns": lambda: check_dns_name("k8s.queue", value)}[check]
    with pytest.raises(ConfigError):
        run()


def documented() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| (.+?) \| `` (.+) `` \| `` (orch: error: .+) `` \|$", line)
        if match:
            rows[match.group(1)] = match.group(3)
    return rows


def table_row(case: Case, message: str) -> str:
    return f"| {case.name} | `` orch {' '.join(case.argv)} `` | `` {message.strip()} `` |"


def test_reliability_table_matches_every_message(outcomes):
    rows = documented()
    stale = []
    for case in CASES:
        shown = outcomes[case.name].shown
        if rows.get(case.name) != shown.strip():
            stale.append(table_row(case, shown))
    assert not stale, "docs/reliability.md is out of date; the rows should read:\n" + "\n".join(stale)
    assert set(rows) == {c.name for c in CASES}, "the table has rows for cases that no longer exist"


if __name__ == "__main__":  # print the table rows for docs/reliability.md
    import tempfile

    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            _, _, shown = run_case(case, Path(tmp))
            print(table_row(case, shown))
