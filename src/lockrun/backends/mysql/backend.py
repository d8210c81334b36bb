"""MySQL and MariaDB: `SessionLockBackend`'s hooks on GET_LOCK, and the lease of a slot.

The semaphore is `lockrun.backends.sessionlock`'s, on GET_LOCK, which the server grants in
arrival order; the head of a semaphore's queue KILLs its losing helper sessions. The holder
proves ownership every ttl/3 with ``IS_USED_LOCK(slot) = CONNECTION_ID()`` and never
reconnects: a session that failed once has lost its locks (docs/design.md P19).
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

import pymysql

from lockrun.backends.mysql.batch import Batch
from lockrun.backends.mysql.modes import HOLD_OPTION, Modes, keepable, mismatch, reading
from lockrun.backends.mysql.records import checked, draw
from lockrun.backends.mysql.session import (
    CANCELLED,
    STATEMENT_ERRORS,
    Server,
    Session,
    said,
    tableless,
    transient,
)
from lockrun.backends.mysql.statements import (
    FORGET,
    MAX_HOLD_US,
    STOP,
    UNMARK,
    WINDOW,
    comment,
    first_free,
    get_lock,
    lock_key,
    slot_lock,
)
from lockrun.backends.mysql.status import read_states
from lockrun.backends.mysql.uri import Settings, carries, parse
from lockrun.backends.sessionlock import GATE, Attempt, SessionLease, SessionLockBackend
from lockrun.errors import ConfigError, LockrunError, TakenOver
from lockrun.timing import DEFAULT_TTL

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from lockrun.backends import LockState, Request
    from lockrun.uri import LockURI


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,  # noqa: ARG001 - nothing to warn of yet
    note: Callable[[str], None] | None = None,
) -> MySQLBackend:
    """Check *uri*; sessions are opened on use, with timeouts that fit leases of *ttl*."""
    return MySQLBackend(parse(uri), ttl or DEFAULT_TTL, note or (lambda _line: None))


class MySQLBackend(SessionLockBackend[Session]):
    """Sessions on one MySQL or MariaDB server."""

    errors = (pymysql.err.Error,)
    waits = "GET_LOCK"

    def __init__(self, settings: Settings, ttl: float, note: Callable[[str], None]) -> None:
        """Remember *settings*; *note* gets what `-v` shows (no fence, and why)."""
        super().__init__()
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.server = Server(settings, ttl, note, self._cancelled)
        self.timeout = self.server.timeout
        self.modes = Modes(self.server)

    def failure(self, err: pymysql.err.Error) -> LockrunError:
        """Translate a PyMySQL error into one line, naming the server but no password."""
        return self.server.failure(err)

    def said(self, err: Exception) -> str:
        """Return the server's or the driver's words for *err*, without a password."""
        assert isinstance(err, pymysql.err.Error)  # noqa: S101 - our `errors` are PyMySQL's
        return said(self.settings, err)

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is KILL QUERY, max_statement_time or max_execution_time's."""
        return isinstance(err, pymysql.err.Error) and err.args[0] in CANCELLED

    def _passing(self, err: BaseException) -> bool:
        return transient(err)

    # -- sessions ------------------------------------------------------------------------

    def _key(self, request: Request) -> str:
        carries(self.settings, request.namespace, request.name)
        return lock_key(request.namespace, request.name)

    def _tag(self, request: Request, token: str) -> str:
        return comment(request, token)

    def _session(self, attempt: Attempt[Session]) -> Session:  # noqa: ARG002 - all alike
        return self.server.session()

    def _revive(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Forget what an earlier acquisition left on a kept *session*; False if it ended."""
        session.unchecked = session.gate_left = None
        return bool(session.connection.open) and super()._revive(session, attempt)

    def _end(self, sessions: Sequence[Session]) -> None:
        """KILL *sessions* we hung up on, so their waits leave the queue now.

        The server notices a hang-up during GET_LOCK only about once a second; an
        interrupted waiter should leave nothing behind at all (best effort).
        """
        with contextlib.suppress(LockrunError, pymysql.err.Error):
            session = self.server.session()
            try:
                for gone in sessions:
                    with contextlib.suppress(pymysql.err.Error):
                        session.one("KILL %s", (gone.id,))
            finally:
                session.close()

    # -- acquiring -----------------------------------------------------------------------

    def _begin(self, session: Session, attempt: Attempt[Session]) -> bool:
        return self.modes.begin(session, attempt)

    def _keepable(self, session: Session, attempt: Attempt[Session]) -> bool:
        return keepable(session, attempt)

    def _lock(
        self, session: Session, part: int | str, seconds: float | None, attempt: Attempt[Session]
    ) -> bool:
        """One GET_LOCK (never a negative timeout, docs/design.md P20).

        After `_refuse_mismatch`, the next one tries at once, with the check in the same
        round trip, and waits in the queue only if the lock is busy. A shared request
        enters beside other shared holders where it can (`Modes.enter_shared`).
        """
        if reading(attempt) and part == 0:
            return self.modes.enter_shared(session, seconds, attempt)
        lock = f"{attempt.key}:{part}"
        if session.unchecked is attempt:
            session.unchecked = None
            try_now = get_lock(lock, 0, "")
            got = checked(session, attempt, try_now, lambda got: lock if got == 1 else None)
            if got is None:  # KILL QUERY from outside
                raise self._cancelled(part)
            if got == 1 or seconds == 0:
                return bool(got == 1)
        return self.server.get(session, lock, seconds, attempt, part)

    def _first_free(self, session: Session, attempt: Attempt[Session]) -> int:
        statement = first_free(attempt.key, attempt.slots)
        if session.unchecked is not attempt:
            return int(session.one(statement))
        session.unchecked = None
        return int(checked(session, attempt, statement, lambda slot: slot_lock(attempt.key, slot)))

    def _refuse_mismatch(self, session: Session, attempt: Attempt[Session]) -> None:
        """Have *attempt*'s next try on *session* refuse a live holder of another N.

        The check goes in that try's round trip (`records.checked`), before any wait in
        the queue; without the tables there is nothing to check. A shared request checked
        already, with its first try (`Modes.enter_shared`).
        """
        session.gate_left = None
        checks = self.server.tables is not False and not reading(attempt)
        session.unchecked = attempt if checks else None

    def _ask(self, session: Session, slot: int, seconds: float, attempt: Attempt[Session]) -> None:
        session.send(get_lock(f"{attempt.key}:{slot}", seconds, attempt.tag))

    def _answer(self, session: Session, slot: int) -> bool:
        got = session.receive()  # the socket is readable: the answer is on its way
        if got is None:
            raise self._cancelled(slot)
        return bool(got == 1)

    def _cancel(self, winner: Session, sessions: Sequence[Session]) -> None:
        """From *winner*, end the other sessions' waits, and any slot they got meanwhile.

        Helpers are KILLed. The first session keeps the gate until the grant is done, so
        only its query is: it then answers NULL (or 1, if it got slot 0 first; closing
        it after the grant frees that too).
        """
        first, *helpers = sessions
        for loser in helpers:
            if loser is not winner:
                with contextlib.suppress(pymysql.err.OperationalError, pymysql.err.InternalError):
                    winner.one("KILL %s", (loser.id,))  # unknown thread: gone already
                loser.abandon()
        if first is not winner:
            winner.one("KILL QUERY %s", (first.id,))
            try:
                first.receive()
            except pymysql.err.Error:  # not the NULL that MariaDB answers: end it all
                first.abandon()
                with contextlib.suppress(pymysql.err.Error):
                    winner.one("KILL %s", (first.id,))

    def _grant(
        self, session: Session, attempt: Attempt[Session], slot: int
    ) -> SessionLease[Session] | None:
        """Record the holder, draw a fence, and refuse a live user with another N.

        Checking after recording ourselves catches two users of different N who got in at
        the same moment: the later check of the two sees the other's record. The same
        round trip reads what the modes left (`Modes.settle`): None if that makes the lock
        busy.
        """
        key = attempt.key
        if attempt.request.shared:
            if not self.modes.grant_shared(session, attempt):
                return None
            mark = f"r:{attempt.token}"
            return MySQLLease(self, session, f"{key}:{mark}", 0, None, attempt, None, mark)
        drawn = draw(self.server, self.modes, session, attempt, slot)
        lock = f"{key}:{slot}"
        if drawn.other is not None:  # leave no row behind, and the slot free; the caller hangs up
            with contextlib.suppress(pymysql.err.Error):
                forget = Batch()
                forget.add(FORGET, (key, slot))
                forget.add("SELECT RELEASE_LOCK(%s)", (lock,))
                session.run(forget)
            raise mismatch(attempt.request, drawn.other)
        if not self.modes.settle(session, attempt, lock, drawn.found):
            session.one("SELECT RELEASE_LOCK(%s)", (lock,))
            return None
        return MySQLLease(self, session, lock, slot, drawn.fence, attempt, drawn.record)

    def _release_gate(self, session: Session, attempt: Attempt[Session]) -> None:
        if session.gate_left is attempt:  # the grant's round trip let it go, after the fence
            session.gate_left = None
            return
        session.one("SELECT RELEASE_LOCK(%s)", (f"{attempt.key}:{GATE}",))

    # -- holding -------------------------------------------------------------------------

    def holds(self, lease: SessionLease[Session]) -> bool:
        """Whether the server still gives *lease*'s slot to its session.

        The same statement asks whether a taker holds the stop lock (``lease.taken``);
        who it is costs a second one, once per taker.
        """
        assert isinstance(lease, MySQLLease)  # noqa: S101 - ours
        row = lease.session.row(
            "SELECT IS_USED_LOCK(%s) = CONNECTION_ID(), IS_USED_LOCK(%s)",
            (lease.key, f"{lease.base}:{STOP}"),
            timeout=self.ttl,
        )
        ours, stop = (None, None) if row is None else row
        if ours != 1 or stop is None:
            lease.taken, lease.taker = None, None
        elif stop != lease.taker:
            lease.taker = stop
            taker = self.modes.who(lease.session, lease.base, stop)
            lease.taken = TakenOver(f"taken over by {taker}")
        return bool(ours == 1)

    def give_back(self, lease: SessionLease[Session]) -> None:
        """RELEASE_LOCK: the next waiter gets the slot at once.

        The holder's row stays: it no longer counts once the slot is free, and the next
        holder replaces it without waiting for a DELETE of ours to commit. A shared
        holder's row goes, in the same round trip: each has a name of its own.
        """
        assert isinstance(lease, MySQLLease)  # noqa: S101 - ours
        if lease.mark is None:
            lease.session.one("SELECT RELEASE_LOCK(%s)", (lease.key,))
            return
        batch = Batch()
        batch.add(UNMARK, (lease.base, lease.mark))
        batch.add("SELECT RELEASE_LOCK(%s)", (lease.key,))
        try:
            lease.session.run(batch)
        except STATEMENT_ERRORS as err:
            if not tableless(err):  # the table went away under us: the lock goes anyway
                raise
            lease.session.one("SELECT RELEASE_LOCK(%s)", (lease.key,))

    def hold_over(self, lease: SessionLease[Session], hold: float) -> None:
        """Leave a window on the server's clock in lockrun_marks, then RELEASE_LOCK.

        The row commits before the release, so whoever the release hands the slot to reads
        it (`Modes.settle`). In one round trip; without the table (and no right to make
        it), `ConfigError` once the slot is free: the hold cannot be kept.
        """
        assert isinstance(lease, MySQLLease)  # noqa: S101 - ours
        request = lease.request
        if lease.mark is not None or request.slots != 1:
            self.give_back(lease)
            msg = "--hold-at-least applies to an exclusive lock of one slot"
            raise ConfigError(msg)
        record = lease.record or json.dumps(request.holder.to_dict())
        micros = min(MAX_HOLD_US, max(1, round(hold * 1_000_000)))
        batch = Batch()
        batch.add(WINDOW, (lease.base, micros, request.namespace, request.name, record))
        batch.add("SELECT RELEASE_LOCK(%s)", (lease.key,))
        try:
            self.modes.need_marks(lease.session, batch, HOLD_OPTION)
        except ConfigError:
            lease.session.one("SELECT RELEASE_LOCK(%s)", (lease.key,))
            raise

    # -- status --------------------------------------------------------------------------

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        carries(self.settings, namespace, name)
        return read_states(self.server, namespace, name)


class MySQLLease(SessionLease[Session]):
    """A slot (or a shared hold) of a session, with what a hold window or a take-over needs."""

    def __init__(
        self,
        backend: MySQLBackend,
        session: Session,
        key: str,
        slot: int,
        fence: int | None,
        attempt: Attempt[Session],
        record: str | None,
        mark: str | None = None,
    ) -> None:
        """Describe *key* (slot *slot*, or the shared holder *mark*) held for *attempt*."""
        super().__init__(backend, session, key, slot, fence)
        self.base: str = attempt.key  # the lock's key without its part: KEY:stop is beside
        self.request = attempt.request
        self.record = record  # the holder's JSON, which a hold window keeps for `status`
        self.mark = mark  # a shared holder's row in lockrun_marks
        self.taker: object = None  # the session whose take-over `taken` names
