"""Leases: one live run at a time per run dir and per checkpoint URL, on any fsspec filesystem.

A lease is a sequence of small JSON files under the URL's root, one per **generation**:
``.orch-lease.<gen:09d>.json`` (``.orch-lease.json``, written by orch before generations, reads as generation
0). The highest generation is the lease; its record (:class:`~.lease_record.LeaseRecord`) names the holding
run, a random token, the holder process, the timeout and the last heartbeat.

Taking the lease is creating the next generation with an exclusive create
(:meth:`~.storage.CheckpointStorage.create_exclusive`: a hard link on local disks and NFS, a conditional PUT on
S3 and GCS), only when the highest one is absent, stale, or (a Kubernetes pod of the same run that proves the
run's secret) taken over on purpose. Of any number of takers that saw the same generation, exactly one
creates the next; a taker then reads back that its generation is the highest, that its file holds its token
and that the generation it judged is still there unchanged (so a taker working from an old listing, whose
judged generation has since been replaced, withdraws). Stale takeover is therefore as atomic as a first take.
The winner deletes the generations below its own; only the holder ever writes its own file (heartbeats), and
releasing deletes it only while it holds the holder's token.

Where a backend has no exclusive create (``atomic_create`` False: fsspec filesystems other than local, s3fs and
gcsfs), the create is check-then-write and the read back is the only defence: two takers within that window may
both win, and the later write shows at the earlier's next heartbeat (``lease_lost``).

The launcher takes its leases before it writes anything and a thread renews them every ``timeout_s / 4``
(:class:`LeaseKeeper`); a holder that finds a higher generation, or its file rewritten, has lost its lease.
Nodes >= 1 of a Kubernetes job take nothing: :class:`LeaseFollower` checks that their run's lease is live.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from typing import Callable, Optional, Union

from orchestrator.errors import ConfigError

from .lease_record import LeaseRecord, judge, proves, this_process
from .storage import CheckpointStorage

log = logging.getLogger(__name__)

LEGACY_LEASE_NAME = ".orch-lease.json"  # orch before generations: generation 0, read and taken over, never written
_GEN_RE = re.compile(r"^\.orch-lease\.(\d{9,})\.json$")
_TAKE_ATTEMPTS = 4


def lease_name(gen: int) -> str:
    """The file name of generation ``gen``."""
    return LEGACY_LEASE_NAME if gen == 0 else f".orch-lease.{gen:09d}.json"


class LeaseFiles:
    """The lease files under one root: list, read, create, write and delete generations."""

    def __init__(self, storage: CheckpointStorage):
        self.storage = storage

    def generations(self) -> list[int]:
        """Every generation present, ascending (the legacy file as 0)."""
        names = self.storage.list_files("")
        gens = [int(m.group(1)) for m in map(_GEN_RE.match, names) if m]
        return sorted(gens + ([0] if LEGACY_LEASE_NAME in names else []))

    def read(self, gen: int) -> Optional[LeaseRecord]:
        """Generation ``gen``'s record; None when it is absent or not a lease (torn by hand, foreign)."""
        try:
            return LeaseRecord.parse(json.loads(self.storage.read_bytes(lease_name(gen))))
        except (FileNotFoundError, ValueError):
            return None

    def current(self) -> tuple[Optional[int], Optional[LeaseRecord]]:
        """The highest generation and its record ((None, None) when there is no lease file)."""
        gens = self.generations()
        if not gens:
            return None, None
        return gens[-1], self.read(gens[-1])

    def create(self, gen: int, record: LeaseRecord) -> bool:
        """Create generation ``gen`` holding ``record``; False when it exists (another taker made it)."""
        self.storage.makedirs()
        return self.storage.create_exclusive(lease_name(gen), _encode(record))

    def write(self, gen: int, record: LeaseRecord) -> None:
        """Replace generation ``gen``'s record (its holder's heartbeat), atomically where the store allows."""
        self.storage.write_bytes_atomic(lease_name(gen), _encode(record))

    def remove(self, gen: int) -> None:
        self.storage.remove_file(lease_name(gen))


def _encode(record: LeaseRecord) -> bytes:
    return json.dumps(record.to_doc()).encode()


class Lease:
    """The lease on ``url`` (a run dir path or a checkpoint URL) for ``run_id``. ``setting`` names the key the
    URL came from, for messages (``run.dir``, ``checkpoint.url``). ``secret``: the run's secret, when the run
    has one every process of it shares: every record is proved with it. ``shared``: a live lease of the same
    run id is taken over (a replacement of a Kubernetes job's node 0) when its proof shows ``secret``, never
    otherwise."""

    def __init__(self, url: str, run_id: str, timeout_s: float, setting: str, shared: bool = False,
                 secret: Optional[str] = None):
        self.url, self.run_id, self.timeout_s, self.setting, self.shared = url, run_id, timeout_s, setting, shared
        self.secret = secret or None
        self.storage = CheckpointStorage(url)
        self.files = LeaseFiles(self.storage)
        self.token = uuid.uuid4().hex
        self.gen: Optional[int] = None
        self.held = False

    def read(self) -> Optional[LeaseRecord]:
        """The lease on the URL now (the highest generation's record), or None."""
        return self.files.current()[1]

    def check(self) -> None:
        """ConfigError (exit 2) naming the holder when another live run holds the lease; takes nothing."""
        _, record = self.files.current()
        if record is not None and record.token != self.token and not self._may_take(record):
            raise self._refusal(record)

    def acquire(self) -> None:
        """Take the lease: ConfigError when another live run holds it, or wins a take at the same moment. A
        ``shared`` lease held live under this run id by a process this one cannot prove to be of its run (a
        replacement of node 0 without the run's secret) is waited for, up to ``timeout_s``: the old holder's
        lease goes stale by then unless it still renews it."""
        give_up = time.monotonic() + (self.timeout_s + 1.0 if self.shared else 0.0)
        while True:
            blocker = self._take()
            if blocker is None:
                return
            if not (self.shared and blocker.run_id == self.run_id) or time.monotonic() >= give_up:
                raise self._refusal(blocker)
            time.sleep(1.0)

    def _take(self) -> Optional[LeaseRecord]:
        """One try: None when the lease is ours now, else the live record that holds it."""
        for _ in range(_TAKE_ATTEMPTS):
            gen, record = self.files.current()
            if record is not None and record.token == self.token:
                self.gen, self.held = gen, True
                return None
            if record is not None and not self._may_take(record):
                return record
            mine = (gen or 0) + 1
            if not self.files.create(mine, self._record()):
                continue  # another taker created that generation first: judge the new one
            if self._won(mine, gen, record):
                self.gen, self.held = mine, True
                self._clear_below(mine)
                return None
            self.files.remove(mine)  # the generation judged was replaced meanwhile: withdraw, judge again
        record = self.files.current()[1]
        if record is None:
            raise ConfigError(self.setting, self.url,
                              "launch again; if this repeats, check that nothing else writes lease files there",
                              "could not be leased: other launches kept taking it at the same moment")
        return record

    def renew(self) -> bool:
        """Heartbeat; False (and no longer held) when the lease is not ours any more: a higher generation
        exists, or our file was rewritten or removed."""
        gens = self.files.generations()
        record = self.files.read(self.gen) if self.gen in gens else None
        if self.gen is None or gens[-1:] != [self.gen] or record is None or record.token != self.token:
            self.held = False
            return False
        self.files.write(self.gen, self._record())
        return True

    def release(self) -> None:
        """Remove the lease if it is still ours (our token in our generation); anything else is left alone."""
        if not self.held or self.gen is None:
            return
        self.held = False
        record = self.files.read(self.gen)
        if record is not None and record.token == self.token:
            self.files.remove(self.gen)

    def _may_take(self, record: LeaseRecord) -> bool:
        if not record.is_live(time.time()):
            return True
        return bool(self.shared and self.secret and record.run_id == self.run_id and proves(record, self.secret))

    def _won(self, mine: int, judged_gen: Optional[int], judged: Optional[LeaseRecord]) -> bool:
        """After creating generation ``mine``: still the highest, still our token, and the generation we judged
        takeable (``judged_gen``, holding ``judged``) unchanged."""
        gens = self.files.generations()
        back = self.files.read(mine)
        if gens[-1:] != [mine] or back is None or back.token != self.token:
            return False
        if judged_gen is None:
            return True
        if judged is None:  # an unreadable file was judged: it must still be there
            return judged_gen in gens
        now = self.files.read(judged_gen) if judged_gen in gens else None
        return now is not None and now.token == judged.token

    def _clear_below(self, mine: int) -> None:
        for gen in self.files.generations():
            if gen < mine:
                try:
                    self.files.remove(gen)
                except Exception:  # noqa: BLE001 - a lower generation left behind is never the lease
                    log.warning("could not remove lease generation %d under %s", gen, self.url, exc_info=True)

    def _record(self) -> LeaseRecord:
        return LeaseRecord.of(self.run_id, self.token, self.timeout_s, this_process(), time.time(), self.secret)

    def _refusal(self, record: LeaseRecord) -> ConfigError:
        where = record.where(time.time())
        if self.shared and record.run_id == self.run_id:
            return ConfigError(
                self.setting, self.url,
                "give every pod of the job the same run secret (k8s.run_secret), or wait: a lease whose holder "
                f"stopped renewing it is taken over after its timeout ({record.timeout_s:g} s)",
                f"is held by live run {record.run_id} ({where}), and this process cannot prove it belongs to "
                "that run (no ORCH_RUN_SECRET, or another one)")
        return ConfigError(
            self.setting, self.url,
            f"wait for that run to end (or `orch stop` it), or use another {self.setting}; a lease whose holder "
            f"stopped renewing it is taken over after its timeout ({record.timeout_s:g} s)",
            f"is in use by live run {record.run_id} ({where})")


class LeaseFollower:
    """A Kubernetes job's node >= 1 on its run's lease at ``url``: takes nothing, and refuses to start (or, while
    running, reports) when the lease there is not a live one of ``run_id`` proved with ``secret``. At start it
    waits up to ``timeout_s`` for node 0 to take the lease."""

    POLL_S = 1.0

    def __init__(self, url: str, run_id: str, timeout_s: float, setting: str, secret: Optional[str] = None):
        self.url, self.run_id, self.timeout_s, self.setting = url, run_id, timeout_s, setting
        self.secret = secret or None
        self.files = LeaseFiles(CheckpointStorage(url))
        self.held = False

    def read(self) -> Optional[LeaseRecord]:
        return self.files.current()[1]

    def check(self) -> None:
        """Nothing to check before starting: node 0 may not have taken the lease yet (see :meth:`acquire`)."""

    def acquire(self) -> None:
        """Wait for a live lease of the run; ConfigError (exit 2) naming what holds the URL instead."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            verdict = judge(self.read(), self.run_id, self.secret, time.time())
            if verdict is None:
                self.held = True
                return
            if verdict.lost_to is not None or time.monotonic() >= deadline:
                raise ConfigError(
                    self.setting, self.url,
                    "start node 0 of the job (it takes the lease), give every pod the same run.id and run secret "
                    f"(k8s.run_secret), and put {self.setting} on storage every pod shares",
                    f"has no live lease of run {self.run_id}: {verdict.reason}")
            time.sleep(self.POLL_S)

    def renew(self) -> bool:
        """False once another run (or a process without the run's secret) holds the lease; an absent or stale
        lease is not lost (node 0 may be being replaced): the workers' commit check refuses saves meanwhile."""
        verdict = judge(self.read(), self.run_id, self.secret, time.time())
        if verdict is not None and verdict.lost_to is not None:
            self.held = False
            return False
        return True

    def release(self) -> None:
        """Nothing to remove: node 0 holds the lease."""
        self.held = False


AnyLease = Union[Lease, LeaseFollower]


class LeaseKeeper:
    """Renews ``leases`` from a daemon thread every ``min(timeout_s) / 4`` until :meth:`release`.
    ``on_lost(lease)`` is called once for a lease found lost (taken over, removed, or held by another run);
    the launcher then stops the run (see orchestrator/launch.py)."""

    def __init__(self, leases: list[AnyLease], on_lost: Callable[[AnyLease], None] = lambda lease: None):
        self.leases, self.on_lost = leases, on_lost
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def check(self) -> None:
        """ConfigError naming the live run holding any of the leases; takes nothing."""
        for lease in self.leases:
            lease.check()

    def acquire(self) -> "LeaseKeeper":
        """Take every lease (releasing those taken if one is refused) and start the heartbeat thread."""
        taken: list[AnyLease] = []
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
