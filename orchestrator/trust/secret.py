"""The run's secret and the MACs made with it.

The launcher makes one secret per launch (:func:`new_run_secret`); agents and workers get it in their
environment (:data:`RUN_SECRET_ENV`) and nowhere else: not the plan, events, logs, run dir or manifests
(Kubernetes pods read it from a Secret reference).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

RUN_SECRET_ENV = "ORCH_RUN_SECRET"
MAC_BYTES = hashlib.sha256().digest_size


def new_run_secret() -> str:
    """The launch's secret: ``ORCH_RUN_SECRET`` when the driver's environment has one (a secret store's, a
    Kubernetes Secret's, a test's), else a fresh 256-bit one."""
    return os.environ.get(RUN_SECRET_ENV) or secrets.token_hex(32)


def mac(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``secret``; each part is length-prefixed, so ("ab", "c") and ("a", "bc")
    never collide."""
    h = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def verify(secret: str, given: bytes, *parts: bytes) -> bool:
    """Whether ``given`` is :func:`mac` of ``parts`` (in constant time)."""
    return hmac.compare_digest(given, mac(secret, *parts))
