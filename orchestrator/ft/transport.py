"""How a recovering replica group gets the live state from a healthy one: orch's torchft CheckpointTransport.

It replaces torchft's ``HTTPTransport``, which listens on every interface, serves anyone, and sends pickles
that the receiver loads with ``weights_only=False``. This one serves through a gate of its own
(:mod:`orchestrator.trust.gate`) on the node's address only (``ORCH_FT_ADDR``): a caller gets the state only
after proving it holds the run's secret, the server proves it too before the caller reads a byte (so a fake
source learns nothing and sends nothing that is read), and the bytes are
:mod:`orchestrator.checkpoint.wire` (safetensors + JSON, no pickle). The source itself is the one the quorum
service named (a member of the quorum the healing group was given), by the address that member registered.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

from torchft.checkpointing.transport import CheckpointTransport

from orchestrator.ft import ADDR_ENV, SECRET_ENV
from orchestrator.checkpoint.wire import decode, encode
from orchestrator.trust.acceptor import listening_socket
from orchestrator.trust.frames import recv_bytes, recv_json, send_bytes, send_json
from orchestrator.trust.gate import Gate
from orchestrator.trust.handshake import connect

ROUTE_PREFIX = "ft/state/"  # + the step
SCHEME = "orch-state://"


class PeerStateTransport(CheckpointTransport[Any]):
    """Serves this worker's staged state to an authenticated peer (route ``ft/state/<step>``); fetches a
    peer's the same way. ``on_served(step, nbytes, seconds)`` is told of every state it sent (for events);
    ``on_refused(peer, reason)`` of every caller turned away."""

    def __init__(self, timeout: timedelta, address: Optional[str] = None, secret: Optional[str] = None,
                 on_served: Optional[Callable[[int, int, float], None]] = None,
                 on_refused: Optional[Callable[[str, str], None]] = None):
        self.address = address or os.environ.get(ADDR_ENV, "127.0.0.1")
        self.secret = secret if secret is not None else os.environ.get(SECRET_ENV, "")
        if not self.secret:
            raise ValueError(f"{SECRET_ENV} is not set: orch's driver gives every agent the run's secret")
        self.timeout = timeout
        self.on_served = on_served
        self._cond = threading.Condition()
        self._step: Optional[int] = None
        self._state: Any = None
        self._payload: Optional[bytes] = None
        self._to_serve = 0  # fetches of the staged state still to come (one per recovering group)
        self._serving = 0  # fetches of it under way
        self.staged = 0  # states staged for a recovering peer so far
        self._gate = Gate(listening_socket(self.address, 0), self.secret, self._route, on_refused,
                          name="orch-ft-state", max_connections=16, max_pending=16)

    # -- torchft's CheckpointTransport ---------------------------------------------------------------------
    def metadata(self) -> str:
        host, port = self._gate.address
        return f"{SCHEME}{host}:{port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        # Kept as is: torchft holds its state-dict lock (no optimizer step) until disallow_checkpoint, and the
        # bytes are made when a peer asks, so a survivor that is never asked pays nothing.
        with self._cond:
            self._step, self._state, self._payload = step, state_dict, None
            self._to_serve = len(dst_ranks)
            self.staged += 1
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._step, self._state, self._payload = None, None, None
            self._to_serve = 0
            self._cond.notify_all()

    def wait_served(self, start_s: float, timeout_s: float) -> bool:
        """Until every recovering group this worker was told to heal has fetched the staged state (or failed to),
        at most ``timeout_s``: a source that trained on meanwhile would start its all-reduces while its peer is
        still fetching, and time out on a state that takes longer to send than ``collective_timeout_s``. A peer
        that has not begun to fetch within ``start_s`` is not waited for (it may be gone). Returns whether every
        fetch is done."""
        started = time.monotonic()
        with self._cond:
            while self._to_serve > 0:
                waited = time.monotonic() - started
                if waited >= timeout_s or (self._serving == 0 and waited >= start_s):
                    return False
                self._cond.wait(min(0.05, timeout_s - waited))
            return True

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        if not metadata.startswith(SCHEME):
            raise ValueError(f"not an orch peer state server: {metadata!r}")
        host, _, port = metadata[len(SCHEME):].rpartition(":")
        sock = connect((host, int(port)), self.secret, f"{ROUTE_PREFIX}{step}", timeout.total_seconds())
        try:
            # The source waits up to its own timeout for the step to be staged, then answers: wait longer.
            sock.settimeout(2 * timeout.total_seconds() + 10)
            status = recv_json(sock)
            if not status.get("ok"):
                raise RuntimeError(f"peer {metadata} has no state for step {step}: {status.get('error')}")
            return decode(recv_bytes(sock))
        finally:
            sock.close()

    def shutdown(self, wait: bool = True) -> None:
        self._gate.close()

    # -- serving -------------------------------------------------------------------------------------------
    def _route(self, route: str):
        if not route.startswith(ROUTE_PREFIX) or not route[len(ROUTE_PREFIX):].isdigit():
            return None
        step = int(route[len(ROUTE_PREFIX):])
        return lambda sock, peer: self._serve(sock, step)

    def _serve(self, sock: socket.socket, step: int) -> None:
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._cond:
            while self._step != step:  # torchft stages the state just before the quorum tells the peer to fetch
                left = deadline - time.monotonic()
                if left <= 0:
                    send_json(sock, {"ok": False, "error": f"step {step} is not staged here (staged: {self._step})"})
                    return
                self._cond.wait(left)
            self._serving += 1
            try:
                if self._payload is None:
                    self._payload = encode(self._state)
                payload = self._payload
            except BaseException:
                self._serving -= 1
                self._to_serve = max(0, self._to_serve - 1)
                raise
        try:
            send_json(sock, {"ok": True})
            send_bytes(sock, payload)
        finally:
            with self._cond:  # served, or the peer is gone: either way nothing more to wait for from it
                self._serving -= 1
                self._to_serve = max(0, self._to_serve - 1)
                self._cond.notify_all()
        if self.on_served is not None:
            self.on_served(step, len(payload), time.perf_counter() - started)
