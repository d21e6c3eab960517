"""Leases: one live run at a time per run dir and per checkpoint URL, on any fsspec filesystem.

A lease is one small JSON object, ``<root>/.orch-lease.json``: the holder's run id, a random token, its host,
PID and process start time, its timeout and the time of its last heartbeat. The launcher takes it before it
writes anything and a thread renews it every ``timeout_s / 4``; the launcher removes it at the end. Another
launch refuses a live lease (exit 2, naming the run) and takes over a stale one: a heartbeat older than the
holder's ``timeout_s``, or, on the same host, a holder process that no longer exists (a killed launcher's lease
needs no waiting).

Object stores have no compare-and-swap that fsspec exposes, so taking a lease is write, then read back: of
two launches racing within the same instant the later write wins and the earlier sees a token not its own at
its read back (or at its next heartbeat, which reports the lease lost).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from orchestrator.errors import ConfigError

from .storage import CheckpointStorage

log = logging.getLogger(__name__)

LEASE_NAME = ".orch-lease.json"


@dataclass(frozen=True)
class LeaseRecord:
    """What a lease file holds."""

    run_id: str
    token: str
    host: str
    pid: int
    pid_start_t: float
    timeout_s: float
    heartbeat_t: float

    def is_live(self, now: float) -> bool:
        """Held by a process that still runs and renewed within its timeout."""
        if now - self.heartbeat_t > self.timeout_s:
            return False
        return self.host != socket.gethostname() or _process_start(self.pid) == self.pid_start_t


def _process_start(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


class Lease:
    """The lease on ``url`` (a run dir path or a checkpoint URL) for ``run_id``. ``setting`` names the key the
    URL came from, for messages (``run.dir``, ``checkpoint.url``). ``shared``: a live lease of the same run id
    is taken over (the pods of one Kubernetes job, a replacement pod) instead of refused."""

    def __init__(self, url: str, run_id: str, timeout_s: float, setting: str, shared: bool = False):
        self.url, self.run_id, self.timeout_s, self.setting, self.shared = url, run_id, timeout_s, setting, shared
        self.storage = CheckpointStorage(url)
        self.token = uuid.uuid4().hex
        self.held = False

    def read(self) -> Optional[LeaseRecord]:
        """The lease on the URL now, or None (absent or unreadable: a torn write is no lease)."""
        try:
            doc = json.loads(self.storage.read_bytes(LEASE_NAME))
            return LeaseRecord(**{k: doc[k] for k in LeaseRecord.__dataclass_fields__})
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def check(self) -> None:
        """ConfigError (exit 2) naming the holder when another live run holds the lease; else nothing."""
        record = self.read()
        if record is None or record.token == self.token or not record.is_live(time.time()):
            return
        if self.shared and record.run_id == self.run_id:
            return
        raise self._held_by(record)

    def acquire(self) -> None:
        """Take the lease (ConfigError when another live run holds it or wins a simultaneous take)."""
        self.check()
        self._write()
        record = self.read()
        if record is None or record.token != self.token:
            raise self._held_by(record) if record else ConfigError(
                self.setting, self.url, "check that the location is writable", "cannot hold a lease (write lost)")
        self.held = True

    def renew(self) -> bool:
        """Heartbeat; False when the lease is no longer ours (taken over after we looked stale)."""
        record = self.read()
        if record is not None and record.token != self.token:
            self.held = False
            return False
        self._write()
        return True

    def release(self) -> None:
        """Remove the lease if it is still ours."""
        if not self.held:
            return
        self.held = False
        record = self.read()
        if record is not None and record.token == self.token:
            self.storage.remove_file(LEASE_NAME)

    def _write(self) -> None:
        me = os.getpid()
        record = LeaseRecord(self.run_id, self.token, socket.gethostname(), me, _process_start(me) or 0.0,
                             self.timeout_s, time.time())
        self.storage.makedirs()
        self.storage.write_bytes_atomic(LEASE_NAME, json.dumps(asdict(record)).encode())

    def _held_by(self, record: LeaseRecord) -> ConfigError:
        age = time.time() - record.heartbeat_t
        return ConfigError(
            self.setting, self.url,
            f"wait for that run to end (or `orch stop` it), or use another {self.setting}; a lease whose holder "
            f"stopped renewing it is taken over after its timeout ({record.timeout_s:g} s)",
            f"is in use by live run {record.run_id} (pid {record.pid} on {record.host}, heartbeat {age:.0f} s ago)")


class LeaseKeeper:
    """Renews ``leases`` from a daemon thread every ``min(timeout_s) / 4`` until :meth:`release`.
    ``on_lost(lease)`` is called once for a lease found taken over (the run goes on; its writes are no longer
    fenced)."""

    def __init__(self, leases: list[Lease], on_lost: Callable[[Lease], None] = lambda lease: None):
        self.leases, self.on_lost = leases, on_lost
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def check(self) -> None:
        """ConfigError naming the live run holding any of the leases; takes nothing."""
        for lease in self.leases:
            lease.check()

    def acquire(self) -> "LeaseKeeper":
        """Take every lease (releasing those taken if one is refused) and start the heartbeat thread."""
        taken: list[Lease] = []
        try:
            for lease in self.leases:
                lease.acquire()
                taken.append(lease)
        except BaseException:
            for lease in taken:
                lease.release()
            raise
        if self.leases:
            self._thread = threading.Thread(target=self._beat, name="orch-lease-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        interval = min(lease.timeout_s for lease in self.leases) / 4
        while not self._stop.wait(interval):
            for lease in self.leases:
                if not lease.held:
                    continue
                try:
                    if not lease.renew():
                        self.on_lost(lease)
                except Exception:  # noqa: BLE001 - a store briefly unreachable: try again at the next beat
                    log.warning("could not renew the lease on %s", lease.url, exc_info=True)

    def release(self) -> None:
        """Stop the heartbeats and remove every lease still held."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for lease in self.leases:
            try:
                lease.release()
            except Exception:  # noqa: BLE001 - the run is over; a lease left behind goes stale
                log.warning("could not remove the lease on %s", lease.url, exc_info=True)
