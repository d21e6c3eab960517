"""``python -m orchestrator.rendezvous.agent <torchrun arguments>``: one node's torchrun agent, on orch's store.

The controller starts every agent this way. Before torchrun's ``main`` runs (in this process, so everything
below lives exactly as long as the agent), it:

1. starts two :class:`~orchestrator.trust.relay.LocalRelay`\\ s on 127.0.0.1, each admitting only this
   process and its descendants, each dialing the run's gate (the ``--rdzv-endpoint``) with the run's secret:
   one to the run's store (torchrun's rendezvous, and per_step's process-group handles: ``ORCH_RUN_STORE``),
   one to the current round's workers' store (``MASTER_ADDR:MASTER_PORT``);
2. registers orch's rendezvous backend with torch's registry (:mod:`~orchestrator.rendezvous.backend`:
   sealed states, per-round workers' stores) and points torchrun at it and at the first relay.

Refused local clients and forged states are recorded in the run dir (``store_client_refused``,
``store_value_refused``) when ``ORCH_RUN_DIR`` is set.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from orchestrator.errors import Preempted
from orchestrator.events import Event, StoreClientRefused, StoreValueRefused
from orchestrator.rundir import EventLog
from orchestrator.trust.relay import LocalRelay
from orchestrator.trust.secret import RUN_SECRET_ENV

from orchestrator.rendezvous.args import AGENT_MODULE as MODULE  # python -m orchestrator.rendezvous.agent
RUN_STORE_ENV = "ORCH_RUN_STORE"  # 127.0.0.1:PORT of this agent's relay to the run's store (for its workers)
RUN_ROUTE = "store/run"
ENDPOINT_FLAG, BACKEND_FLAG = "--rdzv-endpoint=", "--rdzv-backend="


def _flag(argv: list[str], flag: str) -> tuple[int, str]:
    found = [(i, a[len(flag):]) for i, a in enumerate(argv) if a.startswith(flag)]
    if len(found) != 1:
        sys.exit(f"{MODULE}: expected one {flag}... argument, got {len(found)}")
    return found[0]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def recorder(node: str) -> tuple[Callable[[str, str], None], Callable[[str], None]]:
    """(on a refused local client, on a forged state): events in the run dir, at most one a second per kind."""
    run_dir = os.environ.get("ORCH_RUN_DIR")
    events = EventLog(run_dir) if run_dir and os.path.isdir(run_dir) else None
    last: dict[str, float] = {}
    lock = threading.Lock()

    def write(kind: str, event: Event) -> None:
        with lock:
            now = time.monotonic()
            if now - last.get(kind, -1e9) < 1.0:
                return
            last[kind] = now
        if events is not None:
            events.write(event)
        fields = {k: v for k, v in event.fields().items() if k != "node"}
        print(f"[orch] {node}: {event.event} {fields}", file=sys.stderr, flush=True)

    def client_refused(peer: str, reason: str) -> None:
        write(f"client:{peer.rsplit(':', 1)[0]}",
              StoreClientRefused(node=node, peer=peer, port="agent relay", reason=reason))

    def value_refused(key: str) -> None:
        write(f"value:{key}", StoreValueRefused(node=node, key=key, peer="orch's store (read by this agent)",
                                                reason="not sealed with the run's secret"))

    return client_refused, value_refused


def prepare(argv: list[str], secret: str, node: str = "agent") -> tuple[list[str], list[LocalRelay]]:
    """torchrun's ``argv`` on orch's backend and relays (started), and the relays."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from orchestrator.rendezvous.backend import BACKEND_NAME, handler_factory

    i, endpoint = _flag(argv, ENDPOINT_FLAG)
    j, _backend = _flag(argv, BACKEND_FLAG)
    gate = parse_endpoint(endpoint)
    client_refused, value_refused = recorder(node)
    run_relay = LocalRelay(gate, secret, RUN_ROUTE, on_refused=client_refused, name="orch-run-relay")
    workers_relay = LocalRelay(gate, secret, RUN_ROUTE, on_refused=client_refused, name="orch-workers-relay")
    os.environ[RUN_STORE_ENV] = run_relay.endpoint
    rendezvous_handler_registry.register(BACKEND_NAME, handler_factory(secret, workers_relay, value_refused))
    argv = list(argv)
    argv[i] = ENDPOINT_FLAG + run_relay.endpoint
    argv[j] = BACKEND_FLAG + BACKEND_NAME
    return argv, [run_relay, workers_relay]


def store_client(gate: tuple[str, int], secret: str, route: str = RUN_ROUTE,
                 timeout_s: float = 30.0) -> tuple[Any, LocalRelay]:
    """torch's own TCPStore client of a store behind the run's gate, from this process (orch's tools, tests),
    through a relay of this process's tree; close the relay when done with the client."""
    from torch.distributed import TCPStore

    relay = LocalRelay(gate, secret, route, name="orch-client-relay")
    try:
        client = TCPStore("127.0.0.1", relay.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except BaseException:
        relay.close()
        raise
    return client, relay


class PreemptedExitLine(logging.Filter):
    """torchrun's ``failed (exitcode: 75) local_rank: ...`` error, for workers that left with orch's preemption
    exit (an agreed notice, an emergency checkpoint saved), as the one warning line it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("failed (exitcode: %s)") and args and args[0] == Preempted.exit_code:
            record.msg = "local_rank %s (pid %s) left after a preemption notice (exit %s, its checkpoint saved)"
            record.args = (args[1], args[2], args[0])
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def main() -> None:
    secret = os.environ.get(RUN_SECRET_ENV, "")
    if not secret:
        sys.exit(f"{MODULE}: {RUN_SECRET_ENV} is not set (orch's launcher sets it; in a pod, k8s.run_secret)")
    node = f"node{os.environ.get('ORCH_NODE', '?')}"
    args, _relays = prepare(sys.argv[1:], secret, node)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(PreemptedExitLine())
    sys.argv = ["torchrun", *args]
    try:
        torchrun_main(args)
    except SignalException as exc:  # expected: a notice's node leaving, `orch stop`, the controller ending it
        print(f"[orch] {node}: the torchrun agent got {exc.sigval.name} and stopped its workers (a preemption "
              "notice, orch stop, or the controller ending this node)", file=sys.stderr, flush=True)
        sys.exit(1)  # what the traceback's exit was: the controller classifies the exit as before


if __name__ == "__main__":
    main()
