"""The key-value stores a run's driver holds: what torch's TCPStore server holds, in this process.

orch serves torch's store protocol itself (:mod:`~orchestrator.rendezvous.tcpstore_server`), behind the
run's gate, so no TCPStore server of a run listens anywhere; the driver reads and writes its own stores here
directly (:class:`LocalClient`), with no socket at all. Semantics follow torch's server: values are bytes,
``add`` keeps a decimal string, ``compare_set`` on a missing key sets it only when the expected value is
empty, a wait completes once every key it names exists.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable, Optional

KEY_PREFIX = "/"
"""torch's TCPStore client prefixes every key with this; :class:`LocalClient` does too, so both see one key."""

WritePolicy = Callable[[str, bytes, str], bool]  # (key, new value, writer peer) -> accept?


class KeyValueStore:
    """One store (thread-safe). ``policy(key, value, peer)`` may refuse a write (it is not applied; a
    compare-and-set then returns the current value, as a lost race would)."""

    def __init__(self, name: str, policy: Optional[WritePolicy] = None):
        self.name, self.policy = name, policy
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._lock = threading.Lock()
        self._waiters: list[tuple[frozenset[str], Callable[[], None]]] = []
        self._queue_waiters: dict[str, deque[Callable[[bytes], None]]] = {}

    # -- writes -------------------------------------------------------------------------------------------
    def _allowed(self, key: str, value: bytes, peer: str) -> bool:
        return self.policy is None or self.policy(key, value, peer)

    def set(self, key: str, value: bytes, peer: str = "local") -> None:
        if not self._allowed(key, value, peer):
            return
        with self._lock:
            self._data[key] = value
            ready = self._ready_waiters()
        _wake(ready)

    def compare_set(self, key: str, expected: bytes, new: bytes, peer: str = "local") -> bytes:
        with self._lock:
            current = self._data.get(key)
            if current is None:
                if expected or not self._allowed(key, new, peer):
                    return expected if expected else b""
            elif current != expected or not self._allowed(key, new, peer):
                return current
            self._data[key] = new
            ready = self._ready_waiters()
        _wake(ready)
        return new

    def add(self, key: str, amount: int, peer: str = "local") -> int:
        with self._lock:
            current = int(self._data.get(key, b"0") or b"0")
            value = current + amount
            encoded = str(value).encode()
            if not self._allowed(key, encoded, peer):
                return current
            self._data[key] = encoded
            ready = self._ready_waiters()
        _wake(ready)
        return value

    def append(self, key: str, value: bytes, peer: str = "local") -> None:
        with self._lock:
            new = self._data.get(key, b"") + value
            if not self._allowed(key, new, peer):
                return
            self._data[key] = new
            ready = self._ready_waiters()
        _wake(ready)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    # -- reads --------------------------------------------------------------------------------------------
    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            return self._data.get(key)

    def check(self, keys: Iterable[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)

    # -- waiting ------------------------------------------------------------------------------------------
    def when_present(self, keys: Iterable[str], callback: Callable[[], None]) -> Callable[[], bool]:
        """Call ``callback`` (once) as soon as every key of ``keys`` exists: now, or from the thread whose
        write completes them. Returns a cancel function: true when it cancelled a wait still pending."""
        wanted = frozenset(keys)
        entry = (wanted, callback)
        with self._lock:
            if all(k in self._data for k in wanted):
                pending = False
            else:
                self._waiters.append(entry)
                pending = True
        if not pending:
            callback()

        def cancel() -> bool:
            with self._lock:
                try:
                    self._waiters.remove(entry)
                    return True
                except ValueError:
                    return False

        return cancel

    def wait(self, keys: Iterable[str], timeout_s: float) -> bool:
        """Block until every key exists (True) or ``timeout_s`` passes (False)."""
        done = threading.Event()
        cancel = self.when_present(keys, done.set)
        if not done.wait(timeout_s):
            cancel()
            return done.is_set()
        return True

    def _ready_waiters(self) -> list[Callable[[], None]]:
        ready = [cb for wanted, cb in self._waiters if all(k in self._data for k in wanted)]
        if ready:
            self._waiters = [(w, cb) for w, cb in self._waiters if cb not in ready]
        return ready

    # -- queues -------------------------------------------------------------------------------------------
    def queue_push(self, name: str, value: bytes, peer: str = "local") -> None:
        if not self._allowed(name, value, peer):
            return
        with self._lock:
            waiters = self._queue_waiters.get(name)
            if waiters:
                deliver = waiters.popleft()
            else:
                self._queues.setdefault(name, deque()).append(value)
                return
        deliver(value)

    def queue_pop(self, name: str, callback: Callable[[bytes], None]) -> None:
        """``callback(value)`` with the queue's first value: now, or when one is pushed."""
        with self._lock:
            queue = self._queues.get(name)
            if queue:
                value = queue.popleft()
            else:
                self._queue_waiters.setdefault(name, deque()).append(callback)
                return
        callback(value)

    def queue_len(self, name: str) -> int:
        with self._lock:
            return len(self._queues.get(name, ()))


def _wake(callbacks: list[Callable[[], None]]) -> None:
    for cb in callbacks:
        try:
            cb()
        except OSError:  # the waiting client went away
            pass


class LocalClient:
    """The subset of torch's ``TCPStore`` client API orch's driver uses, on a :class:`KeyValueStore` in this
    process (no socket): keys carry torch's client prefix, values are bytes (str is encoded)."""

    def __init__(self, store: KeyValueStore):
        self.store = store

    @staticmethod
    def _b(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(KEY_PREFIX + k for k in keys)

    def get(self, key: str) -> bytes:
        value = self.store.get(KEY_PREFIX + key)
        if value is None:
            raise KeyError(key)
        return value

    def set(self, key: str, value) -> None:
        self.store.set(KEY_PREFIX + key, self._b(value))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.store.compare_set(KEY_PREFIX + key, self._b(expected), self._b(desired))

    def add(self, key: str, amount: int) -> int:
        return self.store.add(KEY_PREFIX + key, amount)

    def delete_key(self, key: str) -> bool:
        return self.store.delete(KEY_PREFIX + key)

    def num_keys(self) -> int:
        return self.store.num_keys()
