"""Launch preflight: what ``orch launch`` checks against this machine before it writes or starts anything, in
one place (:func:`check`).

Each check turns a problem that would otherwise surface only after the agents started (a script that is not
there, a module that does not import, a store host that does not resolve, a busy store port, GPUs this machine
lacks, a checkpoint URL it cannot write, a resume step that was never saved, a live run on the same run dir)
into one ``ConfigError`` line naming the key, the value and the fix (exit 2), with nothing written.
"""

from __future__ import annotations

import importlib.machinery
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError, EnvironmentMismatch


def check(cfg: OrchConfig, site: Any, here: bool = True) -> None:
    """Every check of a launch on ``site`` (an :class:`orchestrator.site.Site`, before it connects): the
    entrypoint, the store's address (when the launch hosts it, ``here``: on this machine), this machine's GPUs
    for the nodes it runs, the checkpoint URL, a resume step, and that no live run holds the run's leases."""
    check_entrypoint(cfg)
    host = site.store_host()
    if here and host is not None:
        check_store_address(cfg, host)
    check_local_resources(cfg, site.nodes_here)
    check_checkpoint_url(cfg)
    check_resume_step(cfg, cfg.checkpoint.url or f"{cfg.run.dir}/checkpoints")
    run_leases(cfg, site.run_id).check()


def check_local_resources(cfg: OrchConfig, nodes_here: int) -> None:
    """EnvironmentMismatch (exit 2) when the ``nodes_here`` nodes that run on this machine need CUDA or NCCL it
    lacks."""
    if nodes_here == 0:
        return
    c = cfg.cluster
    if c.device == "cuda" or cfg.backend.name == "nccl":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = nodes_here * c.nproc_per_node
        if have < need:
            raise EnvironmentMismatch(
                f"cluster.device=cuda: preset {cfg.preset!r} needs {need} CUDA GPU(s) on this machine "
                f"({c.nproc_per_node} per node, {nodes_here} node(s) here), but it has {have}. Fix: "
                f"`orch launch conf={cfg.preset} --dry-run` shows the plan without running it; "
                "`orch launch conf=cpu_gloo` runs on CPUs")
    if cfg.backend.name == "nccl":
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise EnvironmentMismatch("backend.name=nccl: this torch build has no NCCL. Fix: install a CUDA build "
                                      "of torch, or use backend=gloo")


def check_checkpoint_url(cfg: OrchConfig) -> None:
    """Prove an explicit ``checkpoint.url`` writable (the default one lives in the run dir, which does not
    exist yet: probing it would create the run dir; it is created right after)."""
    if cfg.checkpoint.url is not None:  # an empty URL is refused, not taken for the default
        from orchestrator.checkpoint import preflight_storage

        preflight_storage(cfg.checkpoint.url)


def check_entrypoint(cfg: OrchConfig) -> None:
    """``entrypoint.script`` is a file and ``entrypoint.module`` is findable from here, as the workers (started
    in this directory, with this environment) will look for them. Finds the module without importing it."""
    ep = cfg.entrypoint
    if ep.script is not None and not Path(ep.script).is_file():
        raise ConfigError("entrypoint.script", ep.script, f"give the path of a Python file (relative paths start at "
                          f"{os.getcwd()})", "is not a file")
    if ep.module is not None and not _module_findable(ep.module):
        raise ConfigError("entrypoint.module", ep.module, "give an importable module (run from the directory that "
                          "holds its package, or add that directory to PYTHONPATH)", "cannot be found")


def _module_findable(name: str) -> bool:
    # The workers run `python -m` in this directory: the directory, then PYTHONPATH, then site-packages.
    path = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), *sys.path]
    spec = None
    for part in name.split("."):
        if not part.isidentifier():
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return False
        path = list(spec.submodule_search_locations or [])
    return spec is not None


def check_store_address(cfg: OrchConfig, host: Optional[str] = None) -> None:
    """The store this launch hosts can listen on ``host`` (default ``rendezvous.host``): the name resolves, it
    is an address of this machine, and a fixed ``rendezvous.port`` is free there (0 always is). Bound and closed
    again with the function the store itself binds with. (An external store's name, a Kubernetes Service's, may
    resolve only inside the cluster: a launch that dials one hosts no store and checks nothing here.)"""
    r = cfg.rendezvous
    from orchestrator.trust.acceptor import listening_socket

    host = r.host if host is None else host

    fix = "use an address of this machine (127.0.0.1, its IP or host name, or 0.0.0.0 for every interface)"
    try:
        listening_socket(host, 0).close()
    except OSError as e:  # gaierror first: it is an OSError too
        problem = "does not resolve" if isinstance(e, socket.gaierror) else "cannot be listened on here"
        raise ConfigError("rendezvous.host", host, fix, f"{problem} ({e.strerror or e})") from None
    if r.port == 0:
        return
    try:
        listening_socket(host, r.port).close()
    except OSError as e:
        raise ConfigError("rendezvous.port", r.port, "stop what holds it, pick another port, or use 0 for a free one",
                          f"cannot be bound on {host} ({e.strerror or e})") from None


def check_resume_step(cfg: OrchConfig, url: str) -> None:
    """``checkpoint.resume=N`` names a valid checkpoint under ``url``."""
    if not str(cfg.checkpoint.resume).isdigit():
        return
    from orchestrator.checkpoint import CheckpointManager

    step = int(cfg.checkpoint.resume)
    infos = CheckpointManager(url).list()
    valid = [i.step for i in infos if i.valid]
    if step in valid:
        return
    why = next((f"is not valid there ({i.reason})" for i in infos if i.step == step), "names no checkpoint there")
    fix = (f"use one of the valid steps ({', '.join(map(str, valid[-10:]))}), or checkpoint.resume=auto" if valid
           else "use checkpoint.resume=auto or never: nothing valid was saved there")
    raise ConfigError("checkpoint.resume", cfg.checkpoint.resume, fix, f"{why} (checkpoints: {url})")


def make_run_dir(run_dir: str) -> bool:
    """Create the run dir (the launch's first write); returns whether it was new. ConfigError if it cannot be."""
    existed = Path(run_dir).is_dir()
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("run.dir", run_dir, "choose a directory this process can create and write to",
                          f"cannot be created ({e.strerror or e})") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError("run.dir", run_dir, "choose a directory this process can write to", "is not writable")
    return not existed


def run_leases(cfg: OrchConfig, run_id: str, secret: Optional[str] = None):
    """The run's leases (not yet taken): its run dir, and the checkpoint URL it writes (``checkpoint.url``, by
    default ``<run.dir>/checkpoints``); a URL that is the run dir itself is leased once, and ``memory://`` not at
    all (each process has its own). ``secret``: the run's secret, when every process of the run has it; each
    lease then carries its proof.

    Of a Kubernetes job's pods (``cluster.node_index``) node 0 holds them, taking over a live lease of the same
    run id only when it proves the run's secret (a replacement of node 0); nodes >= 1 take none and wait for a
    live lease of their run on the checkpoint URL (the storage every pod shares; each pod's run dir is its
    own) before they start."""
    from orchestrator.checkpoint.lease import Lease, LeaseFollower, LeaseKeeper
    from orchestrator.checkpoint.storage import normalize_url, url_scheme

    node, timeout = cfg.cluster.node_index, cfg.run.lease_timeout_s
    url = cfg.checkpoint.url or f"{cfg.run.dir}/checkpoints"
    leased = url_scheme(url) != "memory" and normalize_url(url) != normalize_url(cfg.run.dir)
    if node not in (None, 0):
        return LeaseKeeper([LeaseFollower(url, run_id, timeout, "checkpoint.url", secret)] if leased else [])
    pod = node is not None
    leases = [Lease(cfg.run.dir, run_id, timeout, "run.dir", shared=pod, secret=secret)]
    if leased:
        leases.append(Lease(url, run_id, timeout, "checkpoint.url", shared=pod, secret=secret))
    return LeaseKeeper(leases)
