"""What a lease file says: its holder, its heartbeat, its proof; and whether that holder is still there.

A holder is named by what tells processes apart across machines and containers: the boot id of its kernel
(``/proc/sys/kernel/random/boot_id``), its PID namespace (the inode of ``/proc/self/ns/pid``), its PID and
that process's start time, plus the host name for people to read. The host name alone is not enough: two
containers (or PID namespaces) on one machine may share it while their PIDs mean different processes.

A record is **live** while its heartbeat is younger than its ``timeout_s``; when its boot id and PID
namespace are both this process's, it is live only while that PID still runs with the recorded start time
(so a killed holder's lease is free at once). From anywhere else (another machine, container or namespace,
or a record written before these fields existed) only the heartbeat's age decides.

The **proof** binds a record to its run: HMAC-SHA256 under the run's secret (``ORCH_RUN_SECRET``) of the run
id and the record's token. A process that holds the secret can tell a record of its own run from one written
under a stolen run id; the secret itself is never written.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Optional

from orchestrator.trust.secret import mac, verify

_PROOF_LABEL = b"orch-lease"


@dataclass(frozen=True)
class Holder:
    """Who a process is, as a lease records it."""

    host: str
    boot_id: str
    pid_ns: int
    pid: int
    pid_start_t: float


def boot_id() -> str:
    """This kernel's boot id ("" where there is none to read)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where there is none to read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start(pid: int) -> Optional[float]:
    """When process ``pid`` (of this PID namespace) started, or None when there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def this_process() -> Holder:
    """The calling process as a holder."""
    pid = os.getpid()
    return Holder(socket.gethostname(), boot_id(), pid_namespace(), pid, process_start(pid) or 0.0)


@dataclass(frozen=True)
class LeaseRecord:
    """One lease file. ``boot_id``, ``pid_ns`` and ``proof`` are empty in files older orch wrote (and
    ``proof`` in a lease whose run has no run-wide secret)."""

    run_id: str
    token: str
    host: str
    pid: int
    pid_start_t: float
    timeout_s: float
    heartbeat_t: float
    boot_id: str = ""
    pid_ns: int = 0
    proof: str = ""

    @classmethod
    def of(cls, run_id: str, token: str, timeout_s: float, holder: Holder, now: float,
           secret: Optional[str]) -> "LeaseRecord":
        """The record ``holder`` writes for ``run_id`` at ``now`` (proved with ``secret`` when given)."""
        proof = lease_proof(secret, run_id, token) if secret else ""
        return cls(run_id, token, holder.host, holder.pid, holder.pid_start_t, timeout_s, now, holder.boot_id,
                   holder.pid_ns, proof)

    @classmethod
    def parse(cls, doc: Any) -> "LeaseRecord":
        """The record in a parsed lease file; ValueError when it is not one (missing or mistyped fields)."""
        if not isinstance(doc, dict):
            raise ValueError("a lease is a JSON object")
        try:
            record = cls(str(doc["run_id"]), str(doc["token"]), str(doc["host"]), int(doc["pid"]),
                         float(doc["pid_start_t"]), float(doc["timeout_s"]), float(doc["heartbeat_t"]),
                         str(doc.get("boot_id") or ""), int(doc.get("pid_ns") or 0), str(doc.get("proof") or ""))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a lease ({type(e).__name__}: {e})") from e
        if not (math.isfinite(record.heartbeat_t) and math.isfinite(record.timeout_s)):
            raise ValueError("a lease's heartbeat_t and timeout_s are times")
        return record

    def to_doc(self) -> dict[str, Any]:
        """The JSON object written for this record."""
        return asdict(self)

    def age_s(self, now: float) -> float:
        """Seconds since the last heartbeat."""
        return now - self.heartbeat_t

    def is_live(self, now: float, me: Optional[Holder] = None) -> bool:
        """Renewed within its timeout and, where this process can check it (same boot id and PID namespace as
        ``me``, default this process), held by a process that still runs."""
        if self.age_s(now) > self.timeout_s:
            return False
        me = me or this_process()
        if self.boot_id and self.pid_ns and (self.boot_id, self.pid_ns) == (me.boot_id, me.pid_ns):
            started = process_start(self.pid)
            return started is not None and abs(started - self.pid_start_t) < 0.01
        return True

    def where(self, now: float) -> str:
        """Who holds it, for messages: ``pid P on HOST, heartbeat N s ago``."""
        return f"pid {self.pid} on {self.host}, heartbeat {max(0.0, self.age_s(now)):.0f} s ago"


def lease_proof(secret: str, run_id: str, token: str) -> str:
    """The proof a holder of ``secret`` records for ``run_id``'s lease with ``token`` (hex)."""
    return mac(secret, _PROOF_LABEL, run_id.encode(), token.encode()).hex()


def proves(record: LeaseRecord, secret: str) -> bool:
    """Whether ``record`` carries a proof made with ``secret`` (a holder of this run's secret wrote it)."""
    try:
        given = bytes.fromhex(record.proof)
    except ValueError:
        return False
    return bool(given) and verify(secret, given, _PROOF_LABEL, record.run_id.encode(), record.token.encode())


@dataclass(frozen=True)
class Verdict:
    """Why a lease is not a live lease of a given run. ``lost_to``: the run now holding it (another run's id,
    or the run id under which a process without the run's secret holds it); None when nobody else does (no
    lease, or a stale one of the run itself)."""

    reason: str
    lost_to: Optional[str] = None


def judge(record: Optional[LeaseRecord], run_id: str, secret: Optional[str], now: float) -> Optional[Verdict]:
    """None when ``record`` is a live lease of ``run_id``, else why not. A record with a proof must be proved
    with ``secret`` (a caller without the secret cannot tell it from a stolen run id's); a record without one
    (a Kubernetes job without a run-wide secret) is judged by its run id alone."""
    if record is None:
        return Verdict("there is no lease on it")
    if record.run_id != run_id:
        return Verdict(f"it is held by run {record.run_id} ({record.where(now)})", record.run_id)
    if record.proof and not (secret and proves(record, secret)):
        return Verdict(f"it is held under run id {run_id} with a proof that this process's run secret does not "
                       f"match ({record.where(now)})", f"{run_id} (another secret)")
    if not record.is_live(now):
        return Verdict(f"its holder stopped renewing it ({record.where(now)})")
    return None
