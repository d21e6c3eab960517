"""The c10d rendezvous store, hosted by a long-lived orch process and never by a worker node.

torchrun agents connect with ``--rdzv-conf is_host=false``, so losing any node never takes rendezvous down:
the survivors re-rendezvous against this store within the keep-alive timeouts.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import TCPStore


class RendezvousStore:
    """A TCPStore server on ``host``:``port`` (0 picks a free port). ``endpoint`` is what agents dial."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0):
        self.host = host
        # multi_tenant: torchrun's own clients open it that way; wait_for_workers=False: agents come and go.
        self._store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout_s))

    @property
    def port(self) -> int:
        return self._store.port

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Drop the server; agents still connected see their next store call fail."""
        self._store = None
