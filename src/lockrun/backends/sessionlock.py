"""Session locks with a gate: a first-in first-out N-slot semaphore on a server's session locks.

MySQL's GET_LOCK and PostgreSQL's advisory locks are both session locks: held by a server
session, freed when it ends.

Both servers queue the waiters for a named lock in arrival order, hand a released lock to
the next of them inside the release, and free every lock of a session that ends. On top
of that, with no polling anywhere:

- One slot: wait in slot 0's queue, in one statement (asking again would put us at the
  back of the queue).
- N slots: wait in the gate's queue. Its holder takes the first free slot or, when none
  is, waits on every slot at once, on its own session for slot 0 and on a helper session
  for each other slot, in pieces of ttl/3 (it is the only one waiting on slots, so it loses
  no place by asking again, and a head that stalls goes idle, so the server's idle limit
  lets the queue go on within ttl/3 and a lease). It keeps the first slot it gets, ends
  the helpers (which frees whatever they got meanwhile), and lets the gate go once its
  fence is drawn, so grants and fences follow the queue. ``--wait 0`` skips the gate and
  tries the slots once.

The order of things is `SessionLocks`'s, given a backend's ports (docs/design.md A6): its
statements (`SessionPort`), what it makes of a request (`RequestPort`), its driver's errors
(`Faults`) and its lease's statements (`LeasePort`). `Idle` keeps released sessions for the
next acquisition; `SessionLease` is the slot a session holds.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import threading
import time
import weakref
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

from lockrun.errors import (
    BackendUnavailable,
    Interrupted,
    LeaseLost,
    LockrunError,
    TakenOver,
)
from lockrun.timing import RECONNECT_INTERVAL, now

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from lockrun.backends import Request

# A released session is kept for the next acquisition (docs/api.md "Connections") for at
# most this part of a lease: the server ends a session idle for a whole lease.
_IDLE_FOR: Final = 0.5
GATE: Final = "gate"  # the part of a name whose queue the waiters of a semaphore join


class Session(Protocol):
    """A server session that holds locks until it ends."""

    def fileno(self) -> int:
        """Return the socket's descriptor."""

    def close(self) -> None:
        """Say goodbye; the server frees the session's locks. Never raises."""

    def hang_up(self) -> None:
        """Cut the connection, even under a statement of another thread. Never raises."""

    def abandon(self) -> None:
        """Hang up at once, mid-statement maybe. Never raises."""


S = TypeVar("S", bound=Session)
K = TypeVar("K")  # the backend's names for a request's slots and gate
X = TypeVar("X")  # the backend's state for one attempt (`Attempt.state`)


class Attempt(Generic[S, K, X]):
    """One pass through the queue: what it waits for and the sessions it opened."""

    def __init__(
        self, request: Request, key: K, token: str, tag: str, deadline: float | None
    ) -> None:
        """Describe a pass for *request* on the backend's *key* until *deadline*."""
        self.request = request
        self.key = key  # the backend's name(s) for the slots and the gate
        self.token = token  # the same for every pass of one acquisition
        self.tag = tag  # who waits, in a comment the server shows with the statement
        self.slots = request.slots
        self.deadline = deadline
        self.opened: list[S] = []
        self.gate: S | None = None  # the session that holds the gate, if any
        self.queued = False  # whether it got as far as waiting in the server's queue
        self.reused = False  # whether its first session was kept from an earlier one
        # A backend whose try also drew the grant's fence (or ran the check of N) keeps
        # when it sent that try: the grant's time; one whose wait carried the grant, when
        # its answer came (PostgreSQL's `grant.wait_and_grant`).
        self.sent: float | None = None
        # When a statement of the grant's on the slot's session last proved it ours, if the
        # grant waited after it began (a hold window, shared holders leaving): the lease
        # runs from there, not from the grant's first statement.
        self.proved: float | None = None
        # The backend's own, between its statements: what a mode registered and found
        # (MySQL's `modes.Mode`), what a try learnt for the grant (PostgreSQL's
        # `grant.Ahead`); None for a plain request.
        self.state: X | None = None


class Outlasted(Exception):
    """Raised by a port when what it found outlasts the deadline; the slot was given back."""


def cancelled(where: str, part: int | str) -> BackendUnavailable:
    """Return the error for a wait cancelled by someone else (a waiter queues again)."""
    what = f"slot {part}" if isinstance(part, int) else f"the {part}"
    return BackendUnavailable(f"{where}: the wait for {what} was cancelled on the server")


def quiet(session: Session) -> bool:
    """Whether an idle *session* heard nothing: the server's only word to one is goodbye."""
    poller = select.poll()
    poller.register(session.fileno(), select.POLLIN)
    return not poller.poll(0)


# -- the ports a backend supplies --------------------------------------------------------


class SessionPort(Protocol[S, K, X]):
    """A backend's sessions and the semaphore's statements on them."""

    def open(self, attempt: Attempt[S, K, X]) -> S:
        """Open a session for *attempt*."""

    def revive(self, session: S, attempt: Attempt[S, K, X]) -> bool:
        """Make a kept *session* ready for *attempt*; False if the server has ended it.

        The server says nothing to an idle session but its goodbye (`quiet`).
        """

    def lock(
        self, session: S, part: int | str, seconds: float | None, attempt: Attempt[S, K, X]
    ) -> bool:
        """Wait up to *seconds* (None: for ever; 0: one try) for *part*; True if ours.

        It may raise `Outlasted`: the wait ends, busy.
        """

    def first_free(self, session: S, attempt: Attempt[S, K, X]) -> int:
        """Take the first free slot in one statement; -1 if none is."""

    def refuse_mismatch(self, session: S, attempt: Attempt[S, K, X]) -> None:
        """Raise `ConfigError` if a live holder of the name uses another N (or on the next try)."""

    def ask(self, session: S, slot: int, seconds: float, attempt: Attempt[S, K, X]) -> None:
        """Send a wait of up to *seconds* for *slot*, without waiting for the answer."""

    def answer(self, session: S, slot: int) -> bool | None:
        """Read `ask`'s answer: True if *slot* is ours, False if the wait ran out.

        None if the answer is not all in yet.
        """

    def cancel(self, winner: S, sessions: Sequence[S]) -> None:
        """From *winner*, end the other sessions' waits, and any slot they got meanwhile."""

    def grant(self, session: S, attempt: Attempt[S, K, X], slot: int) -> SessionLease[S] | None:
        """Draw a fence, record the holder, refuse another N: return the lease.

        None if the slot was given back instead: what the grant found (a hold window, shared
        holders) outlasts the deadline. It may raise `TakenOver` when a take-over asked
        after the attempt queued: it gives way. A grant that waits sets `attempt.proved`.
        """

    def release_gate(self, session: S, attempt: Attempt[S, K, X]) -> None:
        """Let the gate go from *session*, which keeps its slot."""

    def end(self, sessions: Sequence[S]) -> None:
        """End *sessions* we hung up on, on the server, so their waits leave the queue now."""


class RequestPort(Protocol[S, K, X]):
    """What a backend makes of a request: its names, and what its mode registers."""

    def names(self, request: Request, token: str) -> tuple[K, str]:
        """Return the backend's names for *request*'s slots and gate, and the waiter's tag.

        The tag is the comment that names the waiter on the server.
        """

    def begin(self, session: S, attempt: Attempt[S, K, X]) -> bool:
        """Before the first try, register on *session* what the request's mode needs.

        A take-over's stop request, say, which then lasts while the attempt waits and
        ends with its session. False if the deadline passed first (busy).
        """

    def reusable(self, session: S, attempt: Attempt[S, K, X]) -> bool:
        """Whether *session*, whose *attempt* got no slot, holds nothing and may be kept.

        False closes it instead, which frees whatever `begin` took on it.
        """


class Faults(Protocol):
    """A backend's driver errors, and the words for them."""

    errors: tuple[type[Exception], ...]  # the driver's errors: a session may be mid-statement
    where: str  # the server, without a password, for messages
    waits: str  # the statement that waits, for messages

    def failure(self, err: Exception) -> LockrunError:
        """Translate a driver's error into one line naming the server, never a password."""

    def passing(self, err: BaseException) -> bool:
        """Whether *err* is a lost connection a queued waiter may ride out (not a refusal)."""

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is our statement cancelled on the server, its session intact."""

    def said(self, err: Exception) -> str:
        """Return what the driver's *err* says, in one line without a password."""


class LeasePort(Protocol[S]):
    """A backend's statements on the session of a lease."""

    def holds(self, lease: SessionLease[S]) -> bool:
        """Ask on *lease*'s session whether it still holds the slot (the answer may take a ttl).

        No answer within the lease: the server has freed the slot by then. A shorter
        timeout would hang up while the slot may still be ours, and the supervisor stops a
        command whose check hangs on its own schedule. A backend that learns of a take-over
        in the same answer sets ``lease.taken`` (None when there is none).
        """

    def give_back(self, lease: SessionLease[S]) -> None:
        """Release *lease*'s slot on its session; the next waiter gets it at once."""

    def hold_over(self, lease: SessionLease[S], hold: float) -> None:
        """Release *lease*'s slot, leaving it taken *hold* more seconds (--hold-at-least).

        A window on the server, measured by the server's clock, that later acquirers
        respect: nothing of ours stays behind to keep it. A backend that cannot keep one
        releases the slot and raises `ConfigError`.
        """

    def cut(self, lease: SessionLease[S]) -> bool:
        """Hang up under a refresh that hangs.

        Return True once the refresh has let go and this call holds ``lease.busy`` (the
        lease then says goodbye itself and releases it); False to leave the session be.
        """


# -- released sessions, kept ---------------------------------------------------------------


class Idle(Generic[S]):
    """Released sessions kept for the next acquisition; closed with the backend, or at exit."""

    def __init__(self, ttl: float, errors: tuple[type[Exception], ...]) -> None:
        """Keep sessions of leases of *ttl*; *errors* are the driver's (a closed one's)."""
        self.ttl = ttl
        self.errors = errors
        self.taking = True  # False once the backend is interrupted: nothing is kept
        self._sessions: list[tuple[S, float]] = []  # released sessions, and since when idle
        self._lock = threading.Lock()  # a lease may be released in another thread
        weakref.finalize(self, _close_idle, self._sessions, os.getpid())

    def reuse(self, revive: Callable[[S], bool]) -> S | None:
        """Return a kept session that *revive* finds the server has not ended, if there is one."""
        while True:
            with self._lock:
                if not self._sessions:
                    return None
                session, since = self._sessions.pop()
            if now() - since < self.ttl * _IDLE_FOR and self._usable(session, revive):
                return session
            session.abandon()

    def _usable(self, session: S, revive: Callable[[S], bool]) -> bool:
        """Whether a kept *session* can serve again: not closed here, not ended there."""
        try:
            return revive(session)
        except Exception as err:
            if isinstance(err, OSError | self.errors):  # closed on our side: no socket
                return False
            raise

    def forget(self, sessions: Sequence[S]) -> None:
        """Stop keeping any of *sessions* (we hung up on them)."""
        with self._lock:
            self._sessions[:] = [kept for kept in self._sessions if kept[0] not in sessions]

    def put(self, session: S) -> None:
        """Keep *session*, which holds no lock now, for the next acquisition (or close it)."""
        with self._lock:
            if not self._sessions and self.taking:
                self._sessions.append((session, now()))
                return
        session.close()

    def close(self) -> None:
        """Close the kept session; held leases are released by their own `release`."""
        with self._lock:
            kept, self._sessions = self._sessions, []
        for session, _ in kept:
            session.close()


class Holding(Generic[S]):
    """What a lease of a backend works with: its statements, errors, kept sessions, ttl."""

    def __init__(self, port: LeasePort[S], faults: Faults, idle: Idle[S], ttl: float) -> None:
        """Hold slots with *port*'s statements; a released session goes to *kept*."""
        self.port = port
        self.faults = faults
        self.idle = idle
        self.ttl = ttl


# -- the order of things -------------------------------------------------------------------


class Outage:
    """The lost connection of a queued waiter: it queues again, for up to a ttl."""

    def __init__(self, ttl: float) -> None:
        """Ride out an outage of up to *ttl* seconds."""
        self.ttl = ttl
        self.pause = min(RECONNECT_INTERVAL, ttl / 10)  # between two tries to get back in
        self.since: float | None = None  # when the connection of a queued attempt was lost

    def rides_out(self, attempt: Attempt[S, K, X], *, passing: bool) -> bool:
        """Whether *attempt*, which failed (*passing*: a lost connection), may queue again.

        Only a waiter that got as far as the queue rides an outage out, until a ttl after
        it was last queued or its deadline; failing to get in at all is said at once.
        """
        if not passing or (not attempt.queued and self.since is None):
            return False
        if self.since is None or attempt.queued:
            self.since = now()
        deadline = attempt.deadline
        return now() - self.since <= self.ttl and (deadline is None or now() < deadline)


class SessionLocks(Generic[S, K, X]):
    """The semaphore's order of things, over a backend's ports."""

    def __init__(
        self,
        port: SessionPort[S, K, X],
        requests: RequestPort[S, K, X],
        holding: Holding[S],
        timeout: float,
    ) -> None:
        """Queue with *port*'s statements; *timeout* bounds an answer that should come at once."""
        self.port = port
        self.requests = requests
        self.faults = holding.faults
        self.idle = holding.idle
        self.ttl = holding.ttl
        self.timeout = timeout
        self.interrupted = False  # set by `interrupt`: every wait ends, nothing is kept
        self._attempts: list[Attempt[S, K, X]] = []  # those under way, for `interrupt`

    def acquire(self, request: Request, deadline: float | None) -> SessionLease[S] | None:
        """Wait in the server's queue until a slot is ours, or *deadline* passes.

        A waiter that loses its connection (a server restart, a failover) connects and
        queues again, for up to a ttl; failing to get in at all is reported at once. A
        kept session that turns out dead is replaced at once, once.
        """
        token = os.urandom(8).hex()
        key, tag = self.requests.names(request, token)
        outage = Outage(self.ttl)
        while True:
            attempt = Attempt[S, K, X](request, key, token, tag, deadline)
            self._attempts.append(attempt)
            try:
                return self._attempt(attempt)
            except Exception as err:
                if self.interrupted:
                    msg = f"the wait for {request.name} was interrupted; nothing is held"
                    raise Interrupted(msg, signo=signal.SIGINT) from err
                verdict = self._lost(err)
                if verdict is None:
                    raise
                failure, passing = verdict
                if attempt.reused and passing and not attempt.queued:
                    continue  # the server ended it while it was kept: a new one, at once
                if not outage.rides_out(attempt, passing=passing):
                    raise failure from err
                time.sleep(outage.pause)
            finally:
                self._attempts.remove(attempt)

    def interrupt(self) -> None:
        """From another thread: end the waits of `acquire` at once; it raises `Interrupted`.

        Its sessions are cut, so the server drops them from its queues (and `acquire`
        ends them there too); nothing is kept for later.
        """
        self.interrupted = True
        self.idle.taking = False
        for attempt in list(self._attempts):
            for session in list(attempt.opened):
                session.hang_up()

    def _lost(self, err: Exception) -> tuple[LockrunError, bool] | None:
        """Judge a failure: (what to report, whether a queued waiter may ride it out)."""
        if isinstance(err, self.faults.errors):
            return self.faults.failure(err), self.faults.passing(err)
        if isinstance(err, BackendUnavailable):
            return err, self.faults.passing(err)
        return None

    def _attempt(self, attempt: Attempt[S, K, X]) -> SessionLease[S] | None:
        """Queue once; close every session but the holder's, whatever happens.

        The gate is let go only after the grant drew its fence, so fences (and starts)
        follow the order of the queue.
        """
        try:
            slot, holder = self._take(attempt)
            # A session's locks outlive it by nothing, and it idles out (the lease) only
            # after its last statement: the grant's answer, or what `grant` sends next; or,
            # if the try granted and drew the fence in one statement, after that one.
            granted = now() if attempt.sent is None else attempt.sent
            lease = None if holder is None else self.port.grant(holder, attempt, slot)
            if lease is not None:
                lease.confirmed = granted if attempt.proved is None else attempt.proved
            if holder is not None and attempt.gate is holder:
                self.port.release_gate(holder, attempt)
        except BaseException as err:
            for session in attempt.opened:  # mid-statement, maybe: hang up, don't say goodbye
                session.abandon()
            self.idle.forget(attempt.opened)  # a refused grant's release may have kept one
            ended = self.interrupted or not isinstance(err, (LockrunError, *self.faults.errors))
            if ended or isinstance(err, Interrupted):
                self.port.end(attempt.opened)
            raise
        for session in attempt.opened:
            if lease is not None and session is lease.session:
                continue
            if lease is None and attempt.slots == 1 and self.requests.reusable(session, attempt):
                self.idle.put(session)  # a try that failed, a wait that ran out: it holds nothing
            else:
                session.close()  # frees the gate, and anything a loser got
        return lease

    def _open(self, attempt: Attempt[S, K, X]) -> S:
        session = None
        if not attempt.opened:
            session = self.idle.reuse(lambda kept: self.port.revive(kept, attempt))
        attempt.reused = session is not None
        if session is None:
            session = self.port.open(attempt)
        attempt.opened.append(session)
        if self.interrupted:  # after `interrupt` cut what was open
            session.hang_up()
        return session

    def _take(self, attempt: Attempt[S, K, X]) -> tuple[int, S | None]:
        """Get a slot: (slot, the session holding it), or (-1, None) when the wait ends."""
        try:
            return self._queue(attempt)
        except Outlasted:  # a window outlasts the deadline: busy
            return -1, None

    def _queue(self, attempt: Attempt[S, K, X]) -> tuple[int, S | None]:
        """Register the mode, then take one slot, or one of N: at once, or at the gate."""
        first = self._open(attempt)
        if not self.requests.begin(first, attempt):
            return -1, None
        if attempt.slots == 1:
            return (0, first) if self._take_one(first, attempt) else (-1, None)
        self.port.refuse_mismatch(first, attempt)
        if attempt.deadline is not None and attempt.deadline <= now():  # one try: no gate
            slot = self.port.first_free(first, attempt)
            return (slot, first) if slot >= 0 else (-1, None)
        if not self._wait(first, GATE, attempt):
            return -1, None
        attempt.gate = first
        return self._take_at_head(first, attempt)

    def _take_at_head(self, first: S, attempt: Attempt[S, K, X]) -> tuple[int, S | None]:
        """As head of the queue (the gate's holder), get a slot; as `_take`."""
        slot = self.port.first_free(first, attempt)
        if slot >= 0:
            return slot, first
        return self._wait_any(first, attempt)

    def _take_one(self, first: S, attempt: Attempt[S, K, X]) -> bool:
        """Take the one slot on *first*: True when it is ours, False when the wait ends."""
        # A free lock has no queue (the server hands a released lock to the next waiter
        # inside the release): take it in one statement, check N after.
        if self.port.lock(first, 0, 0, attempt):
            return True
        self.port.refuse_mismatch(first, attempt)  # rather than queue behind another N
        return self._wait(first, 0, attempt)

    def _wait(self, session: S, part: int | str, attempt: Attempt[S, K, X]) -> bool:
        """Wait in *part*'s queue on *session* until we hold it (True) or the deadline passes.

        One long wait: asking again would put us at the back of the queue. While it runs
        the server never hears from us; TCP keepalive finds a server that vanished.
        """
        deadline = attempt.deadline
        while True:
            remaining = None if deadline is None else max(0.0, deadline - now())
            attempt.queued = attempt.queued or remaining != 0
            if self.port.lock(session, part, remaining, attempt):
                return True
            if deadline is not None and now() >= deadline:
                return False

    def _wait_any(self, first: S, attempt: Attempt[S, K, X]) -> tuple[int, S | None]:
        """As head of the queue, wait on every slot at once; keep the first slot we get."""
        deadline = attempt.deadline
        sessions = [first] + [self._open(attempt) for _ in range(1, attempt.slots)]
        piece = self.ttl / 3
        with selectors.DefaultSelector() as selector:

            def ask(slot: int) -> None:
                remaining = piece if deadline is None else max(0.0, deadline - now())
                self.port.ask(sessions[slot], slot, min(piece, remaining), attempt)
                selector.register(sessions[slot].fileno(), selectors.EVENT_READ, slot)

            for slot in range(attempt.slots):
                ask(slot)
            pending = attempt.slots
            while pending:
                # After a SIGSTOP the wait returns empty, its time spent: look once more.
                ready = selector.select(piece + self.timeout) or selector.select(0)
                if not ready:
                    where, waits = self.faults.where, self.faults.waits
                    msg = f"{where}: no answer to {waits} within {piece:g}s"
                    raise BackendUnavailable(msg)
                for selected, _ in ready:
                    slot = selected.data
                    got = self.port.answer(sessions[slot], slot)
                    if got is None:
                        continue  # part of the answer
                    selector.unregister(selected.fileobj)
                    pending -= 1
                    if got:
                        self.port.cancel(sessions[slot], sessions)
                        return slot, sessions[slot]
                    if deadline is None or now() < deadline:
                        ask(slot)
                        pending += 1
        return -1, None


class SessionBackend(Generic[S, K, X]):
    """A backend of session locks: `acquire`, `interrupt` and `close` are its `SessionLocks`'."""

    locks: SessionLocks[S, K, X]

    def acquire(self, request: Request, deadline: float | None) -> SessionLease[S] | None:
        """Wait in the server's queue until a slot is ours, or *deadline* passes."""
        return self.locks.acquire(request, deadline)

    def interrupt(self) -> None:
        """From another thread: end the waits of `acquire` at once (`SessionLocks.interrupt`)."""
        self.locks.interrupt()

    def close(self) -> None:
        """Close the idle session; held leases are released by their own `release`."""
        self.locks.idle.close()


class SessionLease(Generic[S]):
    """A slot held by a server session, proven every ttl/3 and never reconnected."""

    def __init__(
        self, holding: Holding[S], session: S, key: int | str, slot: int, fence: int | None
    ) -> None:
        """Describe *slot* (the backend's *key*: a lock name, an advisory key) held by *session*."""
        self.holding = holding
        self.session = session
        self.key = key
        self.slot = slot
        self.fence = fence
        self.ttl: float | None = holding.ttl
        self.confirmed = now()  # the grant's time, set by SessionLocks._attempt
        self.fds: tuple[int, ...] = (session.fileno(),)  # the guardian keeps the session
        self.sessions = self.fds  # the server frees the slot the moment it hangs up
        self.orphan: bytes | None = None  # the slot ends with the session
        self.bells: tuple[int, ...] = ()  # take-over bells (backends.Lease)
        # A take-over that the last check found asked for, set by the port's `holds`.
        self.taken: TakenOver | None = None
        self.released = False
        self.busy = threading.Lock()  # one statement at a time on the session

    def refresh(self) -> None:
        """Prove the slot is still ours; `LeaseLost` if the session or the slot is gone.

        `TakenOver` once it is proven, if another acquirer asked for a take-over.
        """
        faults = self.holding.faults
        with self.busy:
            if self.released:
                return
            try:
                ours = self.holding.port.holds(self)
            except faults.errors as err:
                # The session is not hung up on here: while the command may still run
                # (its TERM grace), the server must not free the slot (docs/semantics.md "Faults").
                said = faults.said(err)
                if faults.was_cancelled(err):  # session and slot intact: ask again
                    msg = f"the check was cancelled on the server ({said})"
                    raise BackendUnavailable(msg) from err
                msg = f"the session holding the lock ended ({said}); its locks are gone"
                raise LeaseLost(msg) from err
        if not ours:
            msg = "the server no longer gives this session the lock"
            raise LeaseLost(msg)
        if self.taken is not None:
            raise self.taken

    def release(self, hold: float = 0.0) -> bool:
        """Give the slot back (the next waiter gets it at once) and end the session.

        With *hold* > 0 the slot stays taken that many more seconds (`LeasePort.hold_over`).
        """
        if self.released:
            return True
        self.released = True
        port = self.holding.port
        if not self.busy.acquire(blocking=False) and not port.cut(self):  # a refresh hangs
            return False
        try:
            if hold > 0:
                port.hold_over(self, hold)
            else:
                port.give_back(self)
        except self.holding.faults.errors:
            self.session.abandon()  # the server frees what a lost session held
            return False
        except BaseException:
            self.session.close()
            raise
        else:
            self.holding.idle.put(self.session)  # free of locks: the next acquisition's
            return True
        finally:
            self.busy.release()


def _close_idle(kept: list[tuple[S, float]], pid: int) -> None:
    """Say goodbye on *kept* sessions, unless this is a forked child (they are the parent's)."""
    if os.getpid() == pid:
        for session, _ in kept:
            session.close()
