"""What orch's driver hosts for ``fault_tolerance.mode=per_step``: the torchft Lighthouse, beside the
rendezvous store (it outlives every node, so the quorum survives the loss of any of them), and the run's
secret for peer-to-peer state transfer."""

from __future__ import annotations

import os
import secrets
from typing import Optional

from orchestrator.config.schema import OrchConfig
from orchestrator.ft import SECRET_ENV


class Lighthouse:
    """A Lighthouse listening on ``host`` only (the plan's address) at a free port; ``address`` is what
    Managers dial (``TORCHFT_LIGHTHOUSE``). ``agent_env``: what every agent gets besides the plan (the run's
    secret: in the environment of orch's processes only, never in plan.json, events or logs)."""

    def __init__(self, cfg: OrchConfig, host: str):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO
        from torchft._torchft import LighthouseServer

        ft = cfg.fault_tolerance
        self._server = LighthouseServer(bind=f"{host}:0", min_replicas=cfg.cluster.min_nodes,
                                        join_timeout_ms=ft.join_timeout_ms, quorum_tick_ms=ft.quorum_tick_ms,
                                        heartbeat_timeout_ms=ft.heartbeat_timeout_ms)
        port = self._server.address().rsplit(":", 1)[1].strip("/")
        self.address = f"http://{host}:{port}"
        self.agent_env = {SECRET_ENV: secrets.token_hex(32)}

    @classmethod
    def for_run(cls, cfg: OrchConfig, host: str) -> Optional["Lighthouse"]:
        """The run's Lighthouse in per_step mode; None in restart mode."""
        return cls(cfg, host) if cfg.fault_tolerance.mode == "per_step" else None

    def close(self) -> None:
        self._server.shutdown()
