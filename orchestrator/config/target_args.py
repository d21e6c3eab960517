"""The arguments of the free-form ``_target_`` nodes (``model``, ``data.dataset``, ``optim``, ``scheduler``)
checked against their targets before anything starts: a number where the target's signature wants one
(``optim.lr=abc`` would otherwise pass composition and fail every worker in a restart loop), within bounds
where a bound is what the argument means (a learning rate is finite and > 0), and, for torch's own
optimizers, accepted by the optimizer itself (constructed once on a one-element tensor).
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from typing import Any, Callable, Optional

from orchestrator.config.values import INT64
from orchestrator.errors import ConfigError

Bound = tuple[Callable[[float], bool], str]  # (holds for the value, the fix when it does not)
POSITIVE: Bound = (lambda v: v > 0, "use a positive, finite number")
NON_NEGATIVE: Bound = (lambda v: v >= 0, "use 0 or a positive, finite number")
AT_LEAST_1: Bound = (lambda v: v >= 1, "use 1 or more")
FRACTION: Bound = (lambda v: 0 <= v <= 1, "use a number from 0 to 1")
BELOW_1: Bound = (lambda v: 0 <= v < 1, "use a number from 0 up to (not including) 1")

# What an argument means does not depend on who implements it for the optimizer and scheduler groups; for
# models and datasets only orch's own targets' arguments are known (a user's model may mean anything by 0).
BOUNDS: dict[str, dict[str, Bound]] = {
    "optim": {"lr": POSITIVE, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "momentum": NON_NEGATIVE,
              "dampening": NON_NEGATIVE, "betas": BELOW_1},
    "scheduler": {"warmup_steps": NON_NEGATIVE, "total_steps": AT_LEAST_1, "min_lr_ratio": FRACTION},
}
OWN_BOUNDS: dict[str, dict[str, Bound]] = {
    "model": {**{k: AT_LEAST_1 for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size",
                                         "max_seq_len")}, "dropout": BELOW_1},
    "data.dataset": {"num_samples": AT_LEAST_1, "seq_len": AT_LEAST_1, "vocab_size": AT_LEAST_1,
                     "mask_prob": FRACTION},
}


def target_facts(obj: Any) -> dict[str, Any]:
    """What checking a target's arguments needs to know of it, as JSON (so it can be remembered without the
    target: orchestrator/config/checked_targets.py): whether it has a signature, whether it takes ``**kwargs``,
    and per parameter ``[name, required, numeric kind]`` (kind: ``int``, ``number``, ``sequence`` or None)."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return {"signature": False, "var_keyword": True, "params": []}  # builtins: instantiate will tell
    hints = _hints(obj)
    return {"signature": True, "var_keyword": any(p.kind is p.VAR_KEYWORD for p in params.values()),
            "params": [[name, p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY),
                        _numeric_kind(hints.get(name), p.default)] for name, p in params.items()]}


def facts_valid(facts: Any) -> bool:
    """Whether ``facts`` has the shape :func:`target_facts` gives (a remembered answer is checked, not trusted)."""
    return (isinstance(facts, dict) and isinstance(facts.get("signature"), bool)
            and isinstance(facts.get("var_keyword"), bool) and isinstance(facts.get("params"), list)
            and all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) for p in facts["params"]))


def check_target_args(key: str, target: str, facts: dict[str, Any], kwargs: dict[str, Any],
                      supplied: tuple = ()) -> None:
    """Raise ConfigError for the first argument of ``kwargs`` that the target ``target`` of node ``key`` (known
    by its ``facts``) cannot take: one it does not accept, one it requires and is missing (``supplied``: those
    the runtime passes itself), the wrong kind of value for a numeric parameter, or one out of its bounds."""
    if not facts["signature"]:
        return
    params = {name: (required, kind) for name, required, kind in facts["params"]}
    if not facts["var_keyword"]:
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", kwargs[unknown[0]],
                              f"{target} accepts: {', '.join(p for p in params if p not in supplied)}",
                              "is not an argument of the target")
    missing = [n for n, (required, _) in params.items() if required and n not in kwargs and n not in supplied]
    if missing:
        raise ConfigError(f"{key}.{missing[0]}", None, f"set it with +{key}.{missing[0]}=...", "is required by the target")
    bounds = {**BOUNDS.get(key, {}), **(OWN_BOUNDS.get(key, {}) if target.startswith("orchestrator.") else {})}
    for name, value in kwargs.items():
        kind = params.get(name, (False, None))[1]
        if kind is None or value is None:
            continue
        numbers = list(value) if kind == "sequence" and isinstance(value, (list, tuple)) else [value]
        for number in numbers:
            _check_number(f"{key}.{name}", value, number, "int" if kind == "int" else "number", target)
            if name in bounds and not bounds[name][0](number):
                raise ConfigError(f"{key}.{name}", value, bounds[name][1], "is out of range")


def _check_number(key: str, value: Any, number: Any, kind: str, target: str) -> None:
    whole = kind == "int"
    ok = isinstance(number, (int, float)) and not isinstance(number, bool) and (
        isinstance(number, int) or (not whole and math.isfinite(number)))
    if not ok:
        what = "a whole number" if whole else "a finite number"
        param = key.rpartition(".")[2]
        raise ConfigError(key, value, f"give {what} ({target}'s {param} is {'an int' if whole else 'a float'})",
                          "has the wrong type" if not isinstance(number, (int, float)) or isinstance(number, bool)
                          else "is not finite")
    if isinstance(number, int) and not -INT64 <= number < INT64:
        raise ConfigError(key, value, f"use a whole number below 2^63 ({INT64 - 1})", "is out of range")


def _numeric_kind(hint: Any, default: Any) -> Optional[str]:
    """``int``, ``number`` (a float, or an int where a float is wanted), ``sequence`` (a tuple of numbers,
    like betas), or None when the parameter is not numeric (or nothing says what it is)."""
    if hint is not None:
        args = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
        if typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in args):
            return "sequence"
        if any(a is str or a is bool for a in args) or not args:
            return None
        if args == [int]:
            return "int"
        return "number" if float in args or int in args else None
    if isinstance(default, bool) or default is inspect.Parameter.empty:
        return None
    return "number" if isinstance(default, (int, float)) else None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _hints(obj: Any) -> dict[str, Any]:
    """Resolved annotations of ``obj``'s constructor (a class) or of ``obj`` (a function); {} if unreadable."""
    try:
        return typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj)
    except Exception:  # unresolvable string annotations, C builtins: fall back to defaults only
        return {}


# How the step runs, not what it computes: they depend on the device (a CPU tensor here, CUDA in the run).
EXECUTION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def constructs(key: str, target: str) -> bool:
    """Whether the target's own constructor is the last check (torch's optimizers check their own arguments in
    ``__init__``: ``nesterov`` needs momentum, ...)."""
    return key == "optim" and target.startswith("torch.optim.")


def construct_optimizer(target: str, cls: Any, kwargs: dict[str, Any]) -> None:
    """Construct optimizer class ``cls`` once on a one-element tensor; ConfigError if it refuses ``kwargs``
    (without the EXECUTION_FLAGS: they depend on the device the run has, not this one)."""
    import torch

    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError("optim", target, "change the optim.* argument it names (see conf/optim/ and the "
                          "torch.optim documentation)", f"refuses its arguments ({str(exc).splitlines()[0]})") from None
