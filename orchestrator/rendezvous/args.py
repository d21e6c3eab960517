"""The rendezvous arguments and environment of every torchrun agent orch starts: the launch plan and the
Kubernetes renderers take them from here, so an agent dials orch's store the same way everywhere. Pure: no
torch, no network."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config.schema import OrchConfig
# What runs in torchrun's place when the store is gated, and the interpreter started ahead that becomes it (named
# in the warm module, which the CLI imports before anything heavy).
from orchestrator.rendezvous.warm import AGENT_MODULE, WARM_MODULE  # noqa: F401

@dataclass(frozen=True)
class AgentRendezvous:
    """One agent's rendezvous, as its fault-tolerance mode gives it: the id, torchrun's ``--nnodes`` and the
    environment the mode adds (orchestrator/ft/driver.py)."""

    id: str
    nnodes: str
    env: dict[str, str] = field(default_factory=dict)


BACKEND = "c10d"
"""torch's c10d rendezvous backend: the state lives in a plain c10d store, the one orch hosts."""


def rendezvous_conf(cfg: OrchConfig) -> str:
    """torchrun's ``--rdzv-conf``: the store lives elsewhere (is_host=false), timeouts from config."""
    r = cfg.rendezvous
    return (f"is_host=false,join_timeout={r.join_timeout_s},last_call_timeout={r.last_call_timeout_s},"
            f"keep_alive_interval={r.keep_alive_interval_s},keep_alive_max_attempt={r.keep_alive_max_attempt}")


def rendezvous_argv(endpoint: str, run_id: str, conf: str) -> tuple[str, ...]:
    """torchrun's ``--rdzv-*`` flags: rendezvous ``run_id`` on the c10d store at ``endpoint`` (host:port), with
    ``conf`` (:func:`rendezvous_conf`). An agent run through :data:`AGENT_MODULE` swaps the backend for orch's."""
    return (
        f"--rdzv-backend={BACKEND}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
    )




def agent_prefix(python: str, gated: bool) -> tuple[str, ...]:
    """The start of an agent's command: orch's agent module for a gated store (every store a launch hosts),
    torchrun itself for one without the run's secret (``k8s.run_secret=''``)."""
    return (python, "-m", AGENT_MODULE if gated else "torch.distributed.run")


def rendezvous_env() -> dict[str, str]:
    """The environment every agent needs for orch's rendezvous."""
    # torchrun caches rank 0's bootstrap address from the first round and never republishes it, so a
    # replacement node joining a later round waits forever for it: publish it every round instead.
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
