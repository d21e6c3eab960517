"""The c10d rendezvous store, hosted by a long-lived orch process and never by a worker node.

torchrun agents connect with ``--rdzv-conf is_host=false``, so losing any node never takes rendezvous down:
the survivors re-rendezvous against this store within the keep-alive timeouts.

Whoever hosts the store also sees every agent exit, which torchrun's rendezvous only learns from a missed
keep-alive: ``evict`` takes a departed agent out of the round at once, so the next round need not wait for
its keep-alive to expire.
"""

from __future__ import annotations

import pickle
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

    def evict(self, run_id: str, agent_pid: int) -> bool:
        """Take the torchrun agent ``agent_pid``, which has exited, out of rendezvous ``run_id``: out of the
        round's participants and waiting nodes, as torchrun's own sweep does once its keep-alive is
        ``keep_alive_interval x keep_alive_max_attempt`` old, and as torchrun's exit op does (a signalled agent
        never runs it). When no participant is left, the next round opens. Returns whether it was there.
        Reads and writes torch's rendezvous state with torch's own backend and compare-and-set, so a
        concurrent change by an agent wins and the eviction is retried on the new state."""
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        client = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=10))
        backend = C10dRendezvousBackend(client, run_id)
        for _ in range(10):
            current = backend.get_state()
            if current is None:
                return False
            raw, token = current
            try:
                state = pickle.loads(raw)
            except Exception:  # a state format this torch does not write: leave it to torchrun's sweep
                return False
            gone = {m for m in (*state.participants, *state.wait_list, *state.redundancy_list) if m.pid == agent_pid}
            if len({m.addr for m in gone}) != 1:
                return False  # not there, or the same PID on two hosts: leave it to torchrun's sweep
            for member in gone:
                state.participants.pop(member, None)
                state.last_heartbeats.pop(member, None)
                state.wait_list.discard(member)
                state.redundancy_list.discard(member)
            if state.complete and not state.participants:
                state.complete, state.round = False, state.round + 1  # torchrun's _remove_participant_epilogue
            written = backend.set_state(pickle.dumps(state), token)
            if written is not None and written[2]:
                return True
        return False

    def close(self) -> None:
        """Drop the server; agents still connected see their next store call fail."""
        self._store = None
