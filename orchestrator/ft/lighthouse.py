"""What orch's driver hosts for ``fault_tolerance.mode=per_step``: the torchft Lighthouse, beside the
rendezvous store (it outlives every node, so the quorum survives the loss of any of them)."""

from __future__ import annotations

from typing import Optional

from orchestrator.config.schema import OrchConfig


class Lighthouse:
    """A Lighthouse listening on ``host`` only (the plan's address) at a free port; ``address`` is what
    Managers dial (``TORCHFT_LIGHTHOUSE``)."""

    def __init__(self, cfg: OrchConfig, host: str):
        from orchestrator.ft import torchft_problem

        torchft_problem()  # imports torchft with its Rust logging at warnings
        from torchft._torchft import LighthouseServer

        ft = cfg.fault_tolerance
        self._server = LighthouseServer(bind=f"{host}:0", min_replicas=cfg.cluster.min_nodes,
                                        join_timeout_ms=ft.join_timeout_ms, quorum_tick_ms=ft.quorum_tick_ms,
                                        heartbeat_timeout_ms=ft.heartbeat_timeout_ms)
        port = self._server.address().rsplit(":", 1)[1].strip("/")
        self.address = f"http://{host}:{port}"

    @classmethod
    def for_run(cls, cfg: OrchConfig, host: str) -> Optional["Lighthouse"]:
        """The run's Lighthouse in per_step mode; None in restart mode."""
        return cls(cfg, host) if cfg.fault_tolerance.mode == "per_step" else None

    def close(self) -> None:
        self._server.shutdown()
