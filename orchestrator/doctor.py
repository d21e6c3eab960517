"""``orch doctor``: the environment check every distributed user otherwise writes by hand.

Each probe is isolated: an exception inside one probe becomes that check's
``detail`` (with ``ok=False``) and never prevents the others from running.

Public API::

    Check(name, ok, detail, required=False)
    run_checks() -> list[Check]
    format_checks(checks) -> str
    main_doctor(json_out=False) -> int   # 0 iff every required check is ok
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import shutil
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

__all__ = ["Check", "run_checks", "format_checks", "main_doctor"]

GIB = 1024**3
SHM_WARN_BYTES = 1 * GIB
NO_CUDA_DETAIL = "no CUDA devices: use conf=cpu_gloo or --dry-run for GPU presets"


@dataclass
class Check:
    """One environment probe result.

    ``required``: a failure means orch cannot run at all (torch import, gloo,
    a hostable c10d store). Non-required failures are warnings.
    """

    name: str
    ok: bool
    detail: str
    required: bool = False


# --------------------------------------------------------------------------- #
# individual probes: each returns (ok, detail)
# --------------------------------------------------------------------------- #


def _probe_python() -> tuple[bool, str]:
    v = sys.version_info
    ok = (v.major, v.minor) >= (3, 11)
    detail = f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"
    if not ok:
        detail += "; orch requires Python >= 3.11"
    return ok, detail


def _probe_torch() -> tuple[bool, str]:
    import torch

    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    if cuda:
        build = f"CUDA {cuda}"
    elif hip:
        build = f"ROCm/HIP {hip}"
    else:
        build = "CPU build"
    return True, f"torch {torch.__version__} ({build})"


def _probe_cuda() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return True, NO_CUDA_DETAIL
    n = torch.cuda.device_count()
    if n == 0:
        return True, NO_CUDA_DETAIL
    parts = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        parts.append(f"cuda:{i} {p.name} {p.total_memory / GIB:.1f} GiB (sm_{p.major}{p.minor})")
    return True, f"{n} device(s): " + "; ".join(parts)


def _probe_nccl() -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    avail = dist.is_available() and dist.is_nccl_available()
    if not avail:
        if has_cuda:
            return False, "NCCL backend not available in this torch build although CUDA devices exist"
        return True, "NCCL not available (expected without CUDA; use the gloo backend)"
    if has_cuda:
        v = torch.cuda.nccl.version()
        if isinstance(v, tuple):
            v = ".".join(str(x) for x in v)
        return True, f"NCCL available, version {v}"
    return True, "NCCL compiled in, but no CUDA devices to use it"


def _probe_gloo() -> tuple[bool, str]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return False, "gloo backend not available in this torch build"
    return True, "gloo backend available"


def _probe_defaults() -> tuple[bool, str]:
    import torch

    detail = f"default dtype {torch.get_default_dtype()}"
    get_dev = getattr(torch, "get_default_device", None)
    if get_dev is not None:
        detail += f", default device {get_dev()}"
    else:
        detail += ", default device n/a (torch.get_default_device missing)"
    return True, detail


def _probe_cpu() -> tuple[bool, str]:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
        src = "sched_getaffinity"
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
        src = "os.cpu_count"
    total = os.cpu_count()
    return True, (
        f"{usable} usable CPU cores ({src}; {total} online), "
        f"torch.get_num_threads()={torch.get_num_threads()}"
    )


def _probe_shm() -> tuple[bool, str]:
    path = "/dev/shm"
    if not os.path.isdir(path):
        return False, f"{path} does not exist: DataLoader workers and NCCL need shared memory"
    du = shutil.disk_usage(path)
    detail = f"{path} total {du.total / GIB:.2f} GiB, free {du.free / GIB:.2f} GiB"
    if du.total < SHM_WARN_BYTES:
        return False, (
            detail + " -- below 1 GiB: DataLoader workers and NCCL use /dev/shm and may crash "
            "(in Docker pass --shm-size or --ipc=host)"
        )
    return True, detail


def _probe_ray() -> tuple[bool, str]:
    try:
        ray = importlib.import_module("ray")
    except ImportError as e:
        return False, f"not installed ({e}); needed only for the Ray launcher"
    return True, f"ray {getattr(ray, '__version__', 'unknown')}"


def _probe_fsspec() -> tuple[bool, str]:
    try:
        fsspec = importlib.import_module("fsspec")
    except ImportError as e:
        return False, f"fsspec not installed ({e}); checkpoints to remote storage unavailable"
    extras = []
    for mod in ("s3fs", "gcsfs"):
        try:
            m = importlib.import_module(mod)
            extras.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001 - optional import may fail arbitrarily
            extras.append(f"{mod} missing ({type(e).__name__})")
    return True, f"fsspec {fsspec.__version__}; " + ", ".join(extras)


def _probe_free_port() -> tuple[bool, str]:
    import torch.distributed as dist

    # 1) the OS can hand us an ephemeral TCP port on loopback
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        sock_port = s.getsockname()[1]
    # 2) a real c10d TCPStore can be hosted (port=0 -> store picks a free one)
    store = dist.TCPStore(
        host_name="127.0.0.1",
        port=0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=15),
    )
    try:
        port = int(store.port)
        store.set("orch_doctor", "ok")
        roundtrip = store.get("orch_doctor")
        if roundtrip != b"ok":
            return False, f"TCPStore on 127.0.0.1:{port} returned {roundtrip!r} for a set/get round trip"
    finally:
        del store
    if port <= 0:
        return False, f"TCPStore reported port {port}"
    return True, (
        f"port {port}: c10d TCPStore can be hosted on 127.0.0.1 "
        f"(plain socket bind also got port {sock_port})"
    )


def _probe_hostname() -> tuple[bool, str]:
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError as e:
        return False, (
            f"hostname {host!r} does not resolve ({e}); multi-node rendezvous "
            "needs a resolvable hostname or an explicit master address"
        )
    return True, f"hostname {host!r} resolves to {addr}"


# name, probe, required
_PROBES: list[tuple[str, Callable[[], tuple[bool, str]], bool]] = [
    ("python", _probe_python, False),
    ("torch", _probe_torch, True),
    ("cuda", _probe_cuda, False),
    ("nccl", _probe_nccl, False),
    ("gloo", _probe_gloo, True),
    ("defaults", _probe_defaults, False),
    ("cpu", _probe_cpu, False),
    ("shm", _probe_shm, False),
    ("ray", _probe_ray, False),
    ("fsspec", _probe_fsspec, False),
    ("free_port", _probe_free_port, True),
    ("hostname", _probe_hostname, False),
]


def _run_one(name: str, probe: Callable[[], tuple[bool, str]], required: bool) -> Check:
    try:
        ok, detail = probe()
    except BaseException as e:  # noqa: BLE001 - one failing probe must never crash the others
        if isinstance(e, KeyboardInterrupt):
            raise
        return Check(name, False, f"{type(e).__name__}: {e}", required)
    return Check(name, bool(ok), str(detail), required)


def run_checks() -> list[Check]:
    """Run every probe; never raises (except on KeyboardInterrupt)."""
    return [_run_one(name, probe, req) for name, probe, req in _PROBES]


# --------------------------------------------------------------------------- #
# output
# --------------------------------------------------------------------------- #


def _status(c: Check) -> str:
    if c.ok:
        return "OK"
    return "FAIL" if c.required else "WARN"


def format_checks(checks: Iterable[Check]) -> str:
    """Plain-text table: STATUS | CHECK | REQUIRED | DETAIL."""
    checks = list(checks)
    headers = ("STATUS", "CHECK", "REQUIRED", "DETAIL")
    rows = [(_status(c), c.name, "yes" if c.required else "no", c.detail) for c in checks]
    widths = [len(h) for h in headers[:3]]
    for r in rows:
        for i in range(3):
            widths[i] = max(widths[i], len(r[i]))

    def line(cols: tuple[str, ...]) -> str:
        head = "  ".join(cols[i].ljust(widths[i]) for i in range(3))
        return f"{head}  {cols[3]}".rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths) + "  " + "-" * 6]
    out.extend(line(r) for r in rows)
    failed = [c.name for c in checks if c.required and not c.ok]
    warned = [c.name for c in checks if not c.required and not c.ok]
    summary = "required checks: " + ("all ok" if not failed else "FAILED: " + ", ".join(failed))
    if warned:
        summary += "; warnings: " + ", ".join(warned)
    out.append("")
    out.append(summary)
    return "\n".join(out)


def _print_rich(checks: list[Check]) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except Exception:  # noqa: BLE001
        return False
    table = Table(title="orch doctor")
    table.add_column("status")
    table.add_column("check", style="bold")
    table.add_column("required")
    table.add_column("detail", overflow="fold")
    style = {"OK": "green", "WARN": "yellow", "FAIL": "bold red"}
    for c in checks:
        st = _status(c)
        table.add_row(f"[{style[st]}]{st}[/]", c.name, "yes" if c.required else "no", c.detail)
    console = Console()
    console.print(table)
    failed = [c.name for c in checks if c.required and not c.ok]
    if failed:
        console.print(f"[bold red]required checks FAILED: {', '.join(failed)}[/]")
    else:
        console.print("[green]required checks: all ok[/]")
    return True


def main_doctor(json_out: bool = False) -> int:
    """Print the checks; return 0 if every required check is ok, else 1."""
    checks = run_checks()
    if json_out:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        isatty = False
        try:
            isatty = sys.stdout.isatty()
        except Exception:  # noqa: BLE001
            pass
        if not (isatty and _print_rich(checks)):
            print(format_checks(checks))
    sys.stdout.flush()
    return 0 if all(c.ok for c in checks if c.required) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main_doctor(json_out="--json" in sys.argv[1:]))
