"""What of the driver's environment a node agent gets: the forwarding decision, in one place.

An agent on the driver's machine inherits the driver's environment anyway (the local pool starts it as a
child process). On another machine (``launcher=ray`` joining a cluster) an agent sees only its Ray worker's
environment, so credentials, tracker settings and the communication knobs the user exported for the job
would be missing there: :func:`forwarded_env` picks them from the driver's environment, by the allow list
below, minus the deny list.

The controller puts these values, under the plan's per-node env, into each agent's process environment when
it starts the agent (``AgentSpec.env``, never recorded). The plan holds only orch's own per-node env, so
``plan.json``, ``events.jsonl`` and the logs never see a forwarded value. That matters, since forwarded
values include secrets (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, ``WANDB_API_KEY``, ...): keep them out of
anything written or shown.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

FORWARDED_PREFIXES = (
    "AWS_",      # S3 checkpoints: credentials, region, endpoint (AWS_ENDPOINT_URL), profile
    "HF_",       # Hugging Face: HF_TOKEN, HF_HOME, HF_HUB_OFFLINE, ...
    "WANDB_",    # logger=wandb
    "MLFLOW_",   # logger=mlflow: tracking URI, credentials
    "NCCL_",     # NCCL tuning and debugging (NCCL_DEBUG, NCCL_SOCKET_IFNAME, ...)
    "GLOO_",     # GLOO_SOCKET_IFNAME, ...
    "TORCH_",    # TORCH_DISTRIBUTED_DEBUG, TORCH_NCCL_*, ...
    "OMP_",      # OMP_NUM_THREADS (the plan's own value for CPU nodes still wins)
)
"""Variables starting with one of these are forwarded (unless denied)."""

FORWARDED_NAMES = frozenset({
    "PYTHONPATH",  # the entrypoint must import on every node as it does here (see forwarded_env)
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
})
"""Variables forwarded by exact name."""

DENIED_NAMES = frozenset({
    # Set per actor by Ray (and per simulated node by the plan): the driver's value would point every agent at
    # the driver's GPUs.
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    # torchrun's agent settings, which orch sets itself through the plan.
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    # AWS's container/instance credential endpoints describe the driver's machine, not the node's.
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
})
"""Never forwarded, although an allowed prefix matches: per-process or per-machine values."""

def is_forwarded(name: str) -> bool:
    """Whether the driver's ``name`` reaches node agents."""
    if name in DENIED_NAMES:
        return False
    return name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)


def forwarded_env(environ: Mapping[str, str], cwd: Optional[str] = None) -> dict[str, str]:
    """The driver's variables (``environ``) that node agents get; the plan's env goes on top.

    ``PYTHONPATH`` entries inside ``cwd`` (the driver's working directory, which the agents start in and which
    a joined Ray cluster gets a copy of, see orchestrator/launchers/ray.py) are followed by the same entry relative to it:
    on another machine the absolute path does not exist and is skipped, and the relative one resolves in
    the agent's copy of the directory.
    """
    env = {name: value for name, value in environ.items() if is_forwarded(name)}
    if env.get("PYTHONPATH") and cwd:
        env["PYTHONPATH"] = _portable_pythonpath(env["PYTHONPATH"], cwd)
    return env


def _portable_pythonpath(value: str, cwd: str) -> str:
    entries = value.split(os.pathsep)
    root = os.path.abspath(cwd)
    relative = []
    for entry in entries:
        if not os.path.isabs(entry):
            continue
        path = os.path.abspath(entry)
        if path == root or path.startswith(root + os.sep):
            rel = os.path.relpath(path, root)
            if rel not in entries and rel not in relative:
                relative.append(rel)
    return os.pathsep.join(entries + relative)
