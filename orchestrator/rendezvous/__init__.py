"""torchrun's c10d rendezvous as orch runs it: the store orch hosts (``store``), the agents' rendezvous
arguments (``args``), the rounds a watch follows (``rounds``), and torch's private rendezvous state
(``state``: the only module that decodes it, checked against each torch by tests/test_rendezvous_contract.py).

``RendezvousStore`` and ``RoundWatch`` import torch: they load on first use, so planning (``args``) does not.
"""

from __future__ import annotations

from orchestrator.plugins import lazy_exports

_EXPORTS = {"RendezvousStore": "store", "RoundWatch": "rounds"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
