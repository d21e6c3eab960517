"""Launches on a remote Ray cluster through the Ray Jobs API: the driver (``orch launch`` itself, joined to the
cluster with ``cluster.address=auto``) runs on the cluster's head node, not in the user's terminal.

``cluster.address=http://HEAD:8265`` (the dashboard) always submits a job; ``ray://HEAD:10001`` does with
``--detach`` (the Jobs API address is then derived from it, as ``ray job submit`` does). The job's
``runtime_env`` ships the working directory (as a joined launch does, ``shipped_runtime_env``) and the forwarded
environment (``forwarded_env``). ``orch stop`` stops the job: Ray sends the driver SIGTERM, which a job's driver
takes as a stop (``ORCH_SIGTERM_STOPS``: notice, emergency checkpoint, status ``stopped``), and waits up to the
grace period plus a margin before killing it (``RAY_JOB_STOP_WAIT_TIME_S``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from orchestrator.errors import EnvironmentMismatch, UserError
from orchestrator.config.schema import OrchConfig
from orchestrator.launch_record import new_record, recordable, write_record

STOP_MARGIN_S = 60  # beyond preemption.grace_period_s: the driver ends its agents and writes the summary
JOB_STATES = {"PENDING": "starting", "RUNNING": "running", "STOPPED": "stopped", "SUCCEEDED": "succeeded",
              "FAILED": "failed"}


def submits_job(address: Optional[str], detach: bool) -> bool:
    """Whether a launch with ``cluster.address=address`` goes through the Ray Jobs API."""
    if not address:
        return False
    return address.startswith(("http://", "https://")) or (detach and address.startswith("ray://"))


def jobs_api_url(address: str) -> str:
    """The dashboard URL the Jobs API answers at, for an ``http(s)://`` or ``ray://`` address."""
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    from ray.dashboard.utils import ray_client_address_to_api_server_url

    return ray_client_address_to_api_server_url(address)


def client(url: str):
    """A JobSubmissionClient for ``url``; EnvironmentMismatch (exit 2) naming the fix when nothing answers."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(url)
    except Exception as exc:  # ConnectionError, or Ray's RuntimeError wrapping one
        raise EnvironmentMismatch(f"cluster.address={url!r}: no Ray Jobs API answers there ({str(exc).splitlines()[0][:160]}). "
                                  "Fix: give the head node's dashboard address (http://HEAD:8265, `ray start --head "
                                  "--include-dashboard=true`), or drop cluster.address to use the embedded Ray") from None


def submit(preset: str, overrides: Sequence[str]) -> tuple[str, str, str]:
    """Check the launch, then submit it as a Ray job; returns (run dir, run id, the Jobs API URL)."""
    from orchestrator.controller.agent_env import forwarded_env
    from orchestrator.controller.controller import SIGTERM_STOPS_ENV
    from orchestrator.launch import check_launchable

    cfg, run_id = check_launchable(preset, overrides, here=False)
    url = jobs_api_url(cfg.cluster.address)
    jobs = client(url)
    run_dir = Path(cfg.run.dir)
    driver_overrides = [o for o in recordable(overrides) if not o.lstrip("+").startswith("cluster.address=")]
    entrypoint = shlex.join(["orch", "launch", f"conf={preset}", *driver_overrides, "cluster.address=auto",
                             f"run.dir={run_dir}", f"run.id={run_id}"])
    env = {**forwarded_env(os.environ, os.getcwd()), SIGTERM_STOPS_ENV: "1", "PYTHONUNBUFFERED": "1",
           "RAY_JOB_STOP_WAIT_TIME_S": str(int(cfg.preemption.grace_period_s) + STOP_MARGIN_S)}
    runtime_env = {**(shipped_runtime_env(cfg, os.getcwd()) or {}), "env_vars": env}
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_record(run_dir, new_record(str(run_dir), run_id, preset, overrides, "ray_job",
                                     ray_job={"address": url, "submission_id": run_id}))
    try:
        jobs.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=run_id)
    except Exception as exc:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing left behind
        raise EnvironmentMismatch(f"cluster.address={cfg.cluster.address!r}: the Ray job was not accepted "
                                  f"({str(exc).splitlines()[0][:200]}). Fix: check the cluster with `ray job list "
                                  f"--address {url}`") from None
    return str(run_dir), run_id, url


def _job(record: dict[str, Any]) -> tuple[Any, str]:
    job = record["ray_job"]
    return client(job["address"]), job["submission_id"]


def job_state(record: dict[str, Any]) -> str:
    """The Ray job's state in orch's words: starting, running, stopped, succeeded or failed."""
    jobs, job_id = _job(record)
    try:
        return JOB_STATES.get(str(jobs.get_job_status(job_id)).rsplit(".", 1)[-1], "stale")
    except RuntimeError:  # the cluster forgot the job
        return "stale"


def job_logs(record: dict[str, Any]) -> str:
    jobs, job_id = _job(record)
    return jobs.get_job_logs(job_id)


def follow_job_logs(record: dict[str, Any], write: Callable[[str], None], poll_s: float = 1.0) -> None:
    """Print the job's log as it grows until the job ends."""
    jobs, job_id = _job(record)
    shown = 0
    while True:
        live = job_state(record) in ("starting", "running")
        text = jobs.get_job_logs(job_id)
        write(text[shown:])
        shown = len(text)
        if not live:
            return
        time.sleep(poll_s)


def stop_job(record: dict[str, Any]) -> None:
    jobs, job_id = _job(record)
    if not jobs.stop_job(job_id):
        raise UserError(f"Ray job {job_id} is not running. Fix: `orch status {record['run_id']}` says how it ended")


def wait_job(record: dict[str, Any], timeout_s: float) -> str:
    """Wait until the job ended; returns its state (``running`` if it still runs after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    state = job_state(record)
    while state in ("starting", "running") and time.monotonic() < deadline:
        time.sleep(1.0)
        state = job_state(record)
    return state


WORKING_DIR_EXCLUDES = (".git", ".hg", ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", "/runs")
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for a job's driver (see submit)


def shipped_runtime_env(cfg: OrchConfig, cwd: str) -> Optional[dict]:
    """Ray's job ``runtime_env`` when joining a cluster (``cluster.address``): this working directory, shipped
    to every node, so that the entrypoint (a relative script path, a module, ``PYTHONPATH`` entries under it)
    imports there as it does here. Node agents start in the copy unless the same path exists on their machine
    (shared storage). None for the embedded Ray and test clusters: their nodes are this machine.

    Left out of the copy: version control, virtual environments, caches, ``runs/`` and the run dir and local
    checkpoint dir when under ``cwd`` (they are written, not read), plus whatever ``.gitignore`` and
    ``.rayignore`` list (Ray reads them)."""
    if not cfg.cluster.address or cfg.cluster.testcluster:
        return None
    if os.environ.get(RAY_JOB_ENV):  # a Ray job's driver: the job shipped it already; Ray refuses a second one
        return None
    excludes = list(WORKING_DIR_EXCLUDES)
    for path in (cfg.run.dir, cfg.checkpoint.url):
        if path and "://" not in path:
            rel = os.path.relpath(os.path.abspath(path), cwd)
            if rel != "." and not rel.startswith(".."):
                excludes.append(f"/{rel}")
    return {"working_dir": cwd, "excludes": excludes}
