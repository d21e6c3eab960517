"""torchrun's c10d rendezvous as orch runs it: the store orch hosts (``store``), the agents' rendezvous
arguments (``args``), the rounds a watch follows (``rounds``), and torch's private rendezvous state
(``state``: the only module that decodes it, checked against each torch by tests/test_rendezvous_contract.py).

``RendezvousStore`` and ``RoundWatch`` import torch: they load on first use, so planning (``args``) does not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RendezvousStore", "RoundWatch"]


def __getattr__(name: str) -> Any:
    if name == "RendezvousStore":
        from orchestrator.rendezvous.store import RendezvousStore

        return RendezvousStore
    if name == "RoundWatch":
        from orchestrator.rendezvous.rounds import RoundWatch

        return RoundWatch
    raise AttributeError(f"module 'orchestrator.rendezvous' has no attribute {name!r}")
