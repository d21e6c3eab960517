"""Parallelism strategies (``parallelism.strategy``): how a model is spread over the ranks, behind one seam
(:class:`~orchestrator.parallel.base.Strategy`). orch's own are ``ddp``, ``fsdp2`` and ``hsdp``; a package of
yours adds one under the ``orch.parallelism`` entry point group (name -> a factory taking the run's config)."""

from __future__ import annotations

from typing import Callable, Optional

from orchestrator.config.schema import PARALLELISM_ENTRY_POINTS, OrchConfig
from orchestrator.parallel.base import Strategy
from orchestrator.plugins import load_named

STRATEGIES: dict[str, str] = {
    "ddp": "orchestrator.parallel.ddp:DDPStrategy",
    "fsdp2": "orchestrator.parallel.fsdp2:FSDP2Strategy",
    "hsdp": "orchestrator.parallel.fsdp2:HSDPStrategy",
}
"""``parallelism.strategy`` name -> ``module:factory``; a factory takes the run's config (or None)."""

StrategyFactory = Callable[[Optional[OrchConfig]], Strategy]


def strategy_factory(name: str) -> StrategyFactory:
    """The factory of strategy ``name``: orch's own (:data:`STRATEGIES`) or an installed plug-in's."""
    return load_named("parallelism.strategy", name, STRATEGIES, PARALLELISM_ENTRY_POINTS, "strategy")


def strategy_for(cfg: Optional[OrchConfig]) -> Strategy:
    """The strategy of the run's config (``ddp`` without one)."""
    name = cfg.parallelism.strategy if cfg is not None else "ddp"
    return strategy_factory(name)(cfg)


__all__ = ["STRATEGIES", "Strategy", "strategy_factory", "strategy_for"]
