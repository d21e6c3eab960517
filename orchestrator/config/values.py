"""Checks of single values that several groups share, run where the config is composed: host names and
addresses, run ids (and the slug generated ids are made from), and numbers bounded where a bound means
something. Pure: no network, no clock (whether a host resolves is the launch preflight's question).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from typing import Any, Iterator
from urllib.parse import urlsplit

from orchestrator.errors import ConfigError

# run.id names files (leases, records), torchrun's rendezvous and every Kubernetes object of a render: a DNS-1123
# label is what all of them accept (lower-case alphanumerics and '-', alphanumeric at both ends, <= 63).
RUN_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
RUN_ID_FIX = ("use at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit "
              "(it names files and Kubernetes objects), or leave run.id unset for a fresh one")
HOST_LABEL = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?$")
INT64 = 2**63
MAX_SECONDS = 10**9  # ~31 years: longer is a typo, and past ~9e9 s Python's own timers raise OverflowError
SECONDS_SUFFIXES = {"_s": MAX_SECONDS, "_ms": MAX_SECONDS * 1000}
RAY_SCHEMES = ("ray", "http", "https")


def check_run_id(value: Any) -> None:
    """``run.id``: ``None`` (a fresh one per launch) or a DNS-1123 label (see ``RUN_ID``)."""
    if value is not None and not (isinstance(value, str) and RUN_ID.fullmatch(value)):
        raise ConfigError("run.id", value, RUN_ID_FIX)


def run_id_slug(preset: str, limit: int) -> str:
    """``preset`` as the start of a generated run id: lower case, runs of other characters as one '-'
    (``cpu_elastic`` -> ``cpu-elastic``), at most ``limit`` characters, never empty."""
    slug = re.sub(r"[^a-z0-9]+", "-", preset.lower()).strip("-")[:limit].strip("-")
    return slug or "run"


def host_problem(host: Any) -> str | None:
    """Why ``host`` is neither an IP address nor a DNS host name (RFC 1123), or None when it is one. A name
    made only of digits and dots is taken for an IPv4 address, as resolvers do: ``999.1.1.1`` is refused."""
    if not isinstance(host, str) or not host.strip():
        return "is empty"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(len(label) <= 63 and HOST_LABEL.fullmatch(label) for label in labels):
        return "is not an IP address or host name"
    if labels[-1].isdigit():
        return "is not a valid IP address"
    return None


def check_host(key: str, value: Any, fix: str, host: Any = None) -> None:
    """``host`` (default: ``value`` itself) is an IP address or a host name; the error names ``key=value``."""
    problem = host_problem(value if host is None else host)
    if problem:
        raise ConfigError(key, value, fix, problem)


def check_url_host(key: str, url: Any, schemes: tuple[str, ...], fix: str) -> None:
    """``url`` is ``SCHEME://HOST[:PORT][/...]`` with one of ``schemes``, a valid host and a TCP port."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(key, url, fix, "is empty")
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        raise ConfigError(key, url, fix, "has an unknown scheme" if parts.scheme else "has no scheme")
    if not parts.hostname:
        raise ConfigError(key, url, fix, "has no host")
    check_host(key, url, fix, host=parts.hostname)
    try:
        port = parts.port
    except ValueError:
        port = -1
    _check_port(key, url, port, fix)


def check_ray_address(address: Any) -> None:
    """``cluster.address``: ``None`` (embedded Ray), ``auto``, ``HOST:PORT``, ``ray://HOST[:PORT]`` or
    ``http(s)://HOST:PORT`` (a dashboard). An empty value is refused rather than taken for ``None``."""
    if address is None or address == "auto":
        return
    fix = "use auto, HOST:PORT, ray://HOST:PORT or http://HOST:8265 (a dashboard), or null for the embedded Ray"
    text = str(address)
    if "://" in text:
        check_url_host("cluster.address", text, RAY_SCHEMES, fix)
        return
    host, colon, port = text.rpartition(":") if ":" in text else (text, "", "")
    check_host("cluster.address", address, fix, host=host.strip("[]") if text.strip() else "")
    if colon:
        _check_port("cluster.address", address, int(port) if port.isdigit() else -1, fix)


def check_endpoint(key: str, value: Any, fix: str) -> None:
    """``HOST:PORT`` (an IPv6 address in brackets), with a valid host and a TCP port."""
    text = str(value)
    host, colon, port = text.rpartition(":")
    if not colon:
        raise ConfigError(key, value, fix, "has no port")
    check_host(key, value, fix, host=host.strip("[]"))
    _check_port(key, value, int(port) if port.isdigit() else -1, fix)


def _check_port(key: str, value: Any, port: int | None, fix: str) -> None:
    """``port`` None means none was given (the scheme's default)."""
    if port is not None and not 0 < port < 65536:
        raise ConfigError(key, value, fix, "has an invalid port")


def check_numbers(cfg: Any, prefix: str = "") -> None:
    """Every number of the typed schema is one a worker can hold: ints within int64 (torch's and JSON
    readers' limit), floats finite, durations (keys ending ``_s``/``_ms``) at most ``MAX_SECONDS``. The
    free-form ``_target_`` nodes are checked against their targets' signatures (target_args.py)."""
    for key, value in _numbers(cfg, prefix):
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise ConfigError(key, value, f"use a whole number below 2^63 ({INT64 - 1})", "is out of range")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "use a finite number", "is not finite")
        limit = next((v for suffix, v in SECONDS_SUFFIXES.items() if key.endswith(suffix)), None)
        if limit is not None and value > limit:
            unit = "seconds" if key.endswith("_s") else "milliseconds"
            raise ConfigError(key, value, f"use at most {limit:,} {unit} (about 31 years)", "is out of range")


def _numbers(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every int and float field under the dataclass ``node`` (bools excluded)."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", value
