"""torch's c10d rendezvous state as orch reads and writes it: the one module that knows its private format.

Every torchrun agent of a run keeps the rendezvous as one value in the c10d store, under
``torch.rendezvous.<run_id>``: a pickled ``torch.distributed.elastic.rendezvous.dynamic_rendezvous.
_RendezvousState``, base64-encoded, written with compare-and-set by torch's ``C10dRendezvousBackend``. That
class is private to torch: its fields (``round``, ``complete``, ``participants``, ...) may change in any
release. So nothing else in orch touches it. Here it is decoded into :class:`RendezvousState`, orch's own
typed copy, and encoded back into torch's class; ``tests/test_rendezvous_contract.py`` checks every field and
behaviour this module relies on against the installed torch, and names the field when a release changes it.

With the run's secret, every state in the store is *sealed*: ``orch-sealed/1.<MAC>.<torch's base64 state>``,
the MAC over the key and the state under the run's secret (:func:`seal`). orch's agents (their rendezvous
backend, :mod:`~orchestrator.rendezvous.backend`) and orch's store (its write policy) check the seal before a
single byte is unpickled, so a state that a holder of the secret did not write never reaches ``pickle``.

Writes go through :func:`update_state`, the same compare-and-set torch's agents use: when an agent wrote in
between, the change is applied again to the newer state, so an agent's own update is never lost.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Optional, TypeVar

from orchestrator.errors import OrchError
from orchestrator.trust.secret import mac, verify

KEY_PREFIX = "torch.rendezvous."
"""torch's ``C10dRendezvousBackend`` key: the state of run id X lives under ``torch.rendezvous.X``; each round's
process-group bootstrap keys live under ``torch.rendezvous.X.<round>/`` beside it."""

NULL_SENTINEL = b"Y2FuaW1hZGFt"
"""What torch's backend writes under the key before there is a state (its ``_NULL_SENTINEL``): a store ``get``
blocks on a missing key, so the backend keeps this placeholder there instead."""

STATE_FIELDS = ("round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
                "last_heartbeats")
"""The attributes of torch's ``_RendezvousState`` that orch reads and writes; any other one is carried over."""

MEMBER_FIELDS = ("addr", "pid", "local_id")
"""The attributes of torch's ``_NodeDesc``, the identity of one agent in the rendezvous."""

PICKLED_CLASSES = frozenset({
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
    # Plain containers: a protocol 4+ pickle (torch's) has opcodes for them, an older protocol names them.
    ("builtins", "set"), ("builtins", "frozenset"),
})
"""The only classes :func:`decode` lets a stored pickle name: what torch's own state pickles reference
(``tests/test_rendezvous_contract.py`` names any other one a torch release adds). Anyone who can reach the store
can write the key, and unpickling any other global (``os.system``, ``builtins.eval``, ...) would run their code
in orch."""

SEAL_PREFIX = b"orch-sealed/1."
"""What a sealed state starts with (see :func:`seal`)."""

T = TypeVar("T")


class RendezvousStateError(OrchError):
    """The store holds a rendezvous state that orch cannot read: torch changed its private format, or someone
    wrote a pickle that names a class torch's state does not."""


class ForgedStateError(RendezvousStateError):
    """A state without a valid seal: not written by a holder of the run's secret (nothing of it is read)."""


def seal(secret: str, key: str, payload: bytes) -> bytes:
    """``payload`` (torch's base64 state) as stored under ``key`` (``torch.rendezvous.<id>``): the prefix, the
    MAC of key and payload under ``secret``, and the payload."""
    return SEAL_PREFIX + mac(secret, b"rendezvous", key.encode(), payload).hex().encode() + b"." + payload


def unseal(secret: str, key: str, stored: bytes) -> bytes:
    """The payload of a sealed ``stored`` value of ``key``; ForgedStateError when the seal is missing or wrong
    (checked in constant time, before anything else reads the bytes)."""
    if not stored.startswith(SEAL_PREFIX):
        raise ForgedStateError(f"rendezvous state {key!r} is not sealed with the run's secret")
    tag, dot, payload = stored[len(SEAL_PREFIX):].partition(b".")
    try:
        given = bytes.fromhex(tag.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        given = b""
    if not dot or not verify(secret, given, b"rendezvous", key.encode(), payload):
        raise ForgedStateError(f"rendezvous state {key!r} has a seal the run's secret did not make")
    return payload


class _StateUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`PICKLED_CLASSES`: every callable a pickle can invoke is looked up
    through ``find_class``, so nothing else in a stored value can run."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PICKLED_CLASSES:
            raise RendezvousStateError(f"refused to unpickle {module}.{name}: not a class of torch's rendezvous state")
        return super().find_class(module, name)


@dataclass(frozen=True, order=True)
class Member:
    """One torchrun agent in the rendezvous (torch's ``_NodeDesc``). Ordered as torch orders them: ranks are
    handed out in this order when a round completes."""

    addr: str
    """The agent's host: ``--local-addr``, or its FQDN."""
    pid: int
    """The agent process's PID on that host."""
    local_id: int
    """A per-process counter (an agent that re-creates its handler gets a new one)."""


@dataclass
class RendezvousState:
    """One run id's rendezvous, as every agent sees it. Round ``round`` is forming while ``complete`` is false
    (agents add themselves to ``participants``) and holds while it is true (newcomers wait in ``wait_list``,
    or in ``redundancy_list`` once ``max_nodes`` participate). Agents restart their workers to join the next
    round as soon as ``wait_list`` is not empty."""

    round: int = 0
    """The round number; each round's process group bootstraps under its own store prefix."""
    complete: bool = False
    """The round has its participants and ranks; nobody joins it any more."""
    closed: bool = False
    """The job is over (an agent finished, or gave up): no agent joins again."""
    deadline: Optional[datetime] = None
    """While forming with at least ``min_nodes``: when the round completes with whoever is there."""
    participants: dict[Member, int] = field(default_factory=dict)
    """The round's members and their ranks (0 for all until the round completes)."""
    wait_list: set[Member] = field(default_factory=set)
    """Agents waiting for the next round; their presence makes the participants' agents re-rendezvous."""
    redundancy_list: set[Member] = field(default_factory=set)
    """Agents waiting while the round is full (``max_nodes``); they trigger no re-rendezvous."""
    last_heartbeats: dict[Member, datetime] = field(default_factory=dict)
    """Each agent's newest keep-alive (UTC); torch's agents drop one whose keep-alive is
    ``keep_alive_interval x keep_alive_max_attempt`` old."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Attributes of torch's state that orch does not know, written back unchanged."""

    def members(self) -> set[Member]:
        """Every agent the rendezvous knows: participants and both lists of waiting agents."""
        return {*self.participants, *self.wait_list, *self.redundancy_list}


@dataclass(frozen=True)
class Eviction:
    """What :func:`evict_member` did. True when an agent was taken out."""

    member: Optional[Member] = None
    """The agent taken out; None when it was not there (or its PID was ambiguous)."""
    was_participant: bool = False
    """It was a member of round ``round`` (before any reopening), not merely waiting."""
    reopened: bool = False
    """Its round was complete and others remain: that round was broken, so the next one was opened for them."""
    round: Optional[int] = None
    """The round the rendezvous is in after the eviction."""

    def __bool__(self) -> bool:
        return self.member is not None


def state_key(run_id: str) -> str:
    """The store key of rendezvous ``run_id``'s state."""
    return KEY_PREFIX + run_id


def torch_version() -> str:
    import torch

    return torch.__version__


def _format_error(key: str, problem: str) -> RendezvousStateError:
    return RendezvousStateError(
        f"rendezvous state {key!r} {problem} (torch {torch_version()}): this torch changed its private c10d "
        "rendezvous format. Fix: use a torch version that tests/test_rendezvous_contract.py passes with (see "
        "pyproject.toml's torch range), or update orchestrator/rendezvous/state.py")


def decode(raw: bytes, key: str = "<rendezvous>", secret: Optional[str] = None) -> Optional[RendezvousState]:
    """The state held in the store as ``raw`` (what a store ``get`` of ``key`` returns); None for torch's
    placeholder before the first state. Raises :class:`RendezvousStateError` for anything else it cannot read.
    The one place in orch's driver that turns stored bytes into objects: with ``secret`` the seal is checked
    first (:class:`ForgedStateError`), and unpickling resolves only :data:`PICKLED_CLASSES` (any other class in
    the pickle: :class:`RendezvousStateError`, naming it, before anything in the pickle runs)."""
    if raw == NULL_SENTINEL:
        return None
    if secret:
        raw = unseal(secret, key, raw)
    try:
        pickled = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _format_error(key, f"is not base64 ({e})") from e
    try:
        obj = _StateUnpickler(io.BytesIO(pickled)).load()
    except RendezvousStateError as e:
        raise RendezvousStateError(f"rendezvous state {key!r}: {e}") from None
    except Exception as e:  # an unpickling failure: a class or module torch renamed, or not a pickle at all
        raise _format_error(key, f"does not unpickle ({type(e).__name__}: {e})") from e
    return _from_torch(obj, key)


def encode(state: RendezvousState, key: str = "<rendezvous>", secret: Optional[str] = None) -> bytes:
    """``state`` as torch's agents read it: their own ``_RendezvousState`` class, pickled, base64-encoded, and
    sealed for ``key`` when there is a ``secret``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    def node(m: Member) -> Any:
        return _NodeDesc(m.addr, m.pid, m.local_id)

    obj = _RendezvousState()
    for name, value in state.extra.items():
        setattr(obj, name, value)
    obj.round, obj.complete, obj.closed, obj.deadline = state.round, state.complete, state.closed, state.deadline
    obj.participants = {node(m): rank for m, rank in state.participants.items()}
    obj.wait_list = {node(m) for m in state.wait_list}
    obj.redundancy_list = {node(m) for m in state.redundancy_list}
    obj.last_heartbeats = {node(m): t for m, t in state.last_heartbeats.items()}
    payload = base64.b64encode(pickle.dumps(obj))
    return seal(secret, key, payload) if secret else payload


def _from_torch(obj: Any, key: str) -> RendezvousState:
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        raise _format_error(key, f"is a {type(obj).__name__}, not an object with fields")
    missing = [name for name in STATE_FIELDS if name not in attrs]
    if missing:
        raise _format_error(key, f"has no field(s) {', '.join(missing)} (it has {', '.join(sorted(attrs))})")

    def member(node: Any) -> Member:
        try:
            return Member(*(getattr(node, name) for name in MEMBER_FIELDS))
        except AttributeError as e:
            raise _format_error(key, f"has a member without {e.name!r} ({node!r})") from e

    return RendezvousState(
        round=attrs["round"], complete=attrs["complete"], closed=attrs["closed"], deadline=attrs["deadline"],
        participants={member(n): rank for n, rank in attrs["participants"].items()},
        wait_list={member(n) for n in attrs["wait_list"]},
        redundancy_list={member(n) for n in attrs["redundancy_list"]},
        last_heartbeats={member(n): t for n, t in attrs["last_heartbeats"].items()},
        extra={k: v for k, v in attrs.items() if k not in STATE_FIELDS})


def connect(host: str, port: int, timeout_s: float = 10.0) -> Any:
    """A client of the c10d store at ``host:port`` (a ``torch.distributed.TCPStore``)."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def read_state(client: Any, run_id: str, secret: Optional[str] = None) -> Optional[RendezvousState]:
    """Rendezvous ``run_id``'s state in the store ``client`` talks to; None before any agent wrote one.
    ``secret``: the run's, when the state is sealed."""
    key = state_key(run_id)
    if not client.check([key]):
        return None
    return decode(client.get(key), key, secret)


def update_state(client: Any, run_id: str, change: Callable[[RendezvousState], Optional[T]],
                 attempts: int = 10, secret: Optional[str] = None) -> Optional[T]:
    """Apply ``change`` to rendezvous ``run_id``'s state and write it back with compare-and-set, as torch's
    agents do. ``change`` edits the state it is given and returns what to report, or None to write nothing.
    When an agent wrote in between, ``change`` runs again on the newer state. Returns ``change``'s result once
    written; None when there is no state, ``change`` declined, or agents kept winning for ``attempts`` tries."""
    key = state_key(run_id)
    for _ in range(attempts):
        if not client.check([key]):
            return None
        raw = client.get(key)
        state = decode(raw, key, secret)
        if state is None:
            return None
        result = change(state)
        if result is None:
            return None
        new = encode(state, key, secret)
        if client.compare_set(key, raw, new) == new:
            return result
    return None


def evict_member(state: RendezvousState, agent_pid: int) -> Optional[Eviction]:
    """Take the agent with PID ``agent_pid`` out of ``state``, as torch's own sweep does once its keep-alive
    expires (and as its exit op does, which a killed agent never runs). None when no member has that PID, or
    members on two hosts do (PIDs are per host: leave that to torch's sweep).

    A forming round then completes with whoever is there (at its deadline, as torch's agents decide). A
    complete round the agent was part of is broken: its survivors' workers would wait for the missing rank in
    process-group setup until ``backend.timeout_s``, so when others remain it is :func:`reopen`-ed."""
    gone = {m for m in state.members() if m.pid == agent_pid}
    if len({m.addr for m in gone}) != 1:
        return None
    was_participant = any(m in state.participants for m in gone)
    for m in gone:
        state.participants.pop(m, None)
        state.last_heartbeats.pop(m, None)
        state.wait_list.discard(m)
        state.redundancy_list.discard(m)
    reopened = False
    if was_participant and state.complete:
        if not state.participants:
            # torch's _remove_participant_epilogue: nobody holds the round any more, the next one opens.
            state.complete, state.round = False, state.round + 1
        elif not state.closed:
            reopen(state)
            reopened = True
    # A forming round keeps its deadline: torch would clear it below min_nodes (unknown here), but it only
    # completes a round with at least min_nodes participants and sets a fresh deadline on reaching it again.
    return Eviction(member=min(gone), was_participant=was_participant, reopened=reopened, round=state.round)


def reopen(state: RendezvousState) -> None:
    """Open the next round for the participants of the current one: they move to the wait list, so at its next
    health check (``--monitor-interval``) each one's agent sees ``num_nodes_waiting() > 0``, stops its workers
    (a membership change: no restart is used up) and joins round ``round + 1`` as a participant. The round
    completes with whoever joined by ``last_call_timeout`` after ``min_nodes`` did, or at ``max_nodes``.
    Their keep-alives stay, so torch's sweep still drops one that is gone too."""
    state.wait_list.update(state.participants)
    state.participants = {}
    state.complete, state.deadline, state.round = False, None, state.round + 1


def evict(client: Any, run_id: str, agent_pid: int, secret: Optional[str] = None) -> Eviction:
    """:func:`evict_member` on rendezvous ``run_id``'s state in the store, by compare-and-set. A falsy
    :class:`Eviction` when the agent was not there (or the state cannot be read)."""
    try:
        done = update_state(client, run_id, lambda state: evict_member(state, agent_pid), secret=secret)
    except RendezvousStateError:
        return Eviction()  # a format this orch does not know: torch's own keep-alive sweep still drops the agent
    return done or Eviction()
