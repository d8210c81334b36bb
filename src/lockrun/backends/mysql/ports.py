"""MySQL's ports of the session-lock semaphore: its statements on GET_LOCK, requests, faults.

The order of things is `lockrun.backends.sessionlock.SessionLocks`'s (docs/design.md A6);
these give it GET_LOCK, which the server grants in arrival order. The head of a semaphore's
queue KILLs its losing helper sessions.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pymysql

from lockrun.backends.mysql.batch import Batch
from lockrun.backends.mysql.lease import MySQLLease
from lockrun.backends.mysql.modes import mismatch, reading, reusable
from lockrun.backends.mysql.records import Drawn, checked, draw, try_drawing
from lockrun.backends.mysql.session import CANCELLED, said, transient
from lockrun.backends.mysql.statements import (
    FORGET,
    OURS,
    comment,
    first_free,
    get_lock,
    lock_key,
    slot_lock,
)
from lockrun.backends.mysql.uri import carries
from lockrun.backends.sessionlock import GATE, cancelled, quiet
from lockrun.errors import LockrunError
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lockrun.backends import Request
    from lockrun.backends.mysql.modes import Mode, Modes
    from lockrun.backends.mysql.session import Server, Session
    from lockrun.backends.mysql.uri import Settings
    from lockrun.backends.sessionlock import Attempt, Holding

    Try = Attempt[Session, str, Mode]


class Faults:
    """PyMySQL's errors, judged and said without a password."""

    errors: tuple[type[Exception], ...] = (pymysql.err.Error,)
    waits = "GET_LOCK"

    def __init__(self, server: Server) -> None:
        """Judge the errors of *server*'s sessions."""
        self.server = server
        self.where = server.where

    def failure(self, err: Exception) -> LockrunError:
        """Translate a PyMySQL error into one line, naming the server but no password."""
        assert isinstance(err, pymysql.err.Error)  # noqa: S101 - our `errors` are PyMySQL's
        return self.server.failure(err)

    def passing(self, err: BaseException) -> bool:
        """Whether *err* is a lost connection a queued waiter may ride out."""
        return transient(err)

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is KILL QUERY, max_statement_time or max_execution_time's."""
        return isinstance(err, pymysql.err.Error) and err.args[0] in CANCELLED

    def said(self, err: Exception) -> str:
        """Return the server's or the driver's words for *err*, without a password."""
        assert isinstance(err, pymysql.err.Error)  # noqa: S101 - our `errors` are PyMySQL's
        return said(self.server.settings, err)


class Requests:
    """A request's lock key and comment, and what its mode registers (`modes.Modes`)."""

    def __init__(self, settings: Settings, modes: Modes) -> None:
        """Name locks on the server of *settings*; *modes* registers shared and take-over."""
        self.settings = settings
        self.modes = modes

    def names(self, request: Request, token: str) -> tuple[str, str]:
        """Return *request*'s lock key (a digest: the slots are KEY:0 …) and the waiter's tag."""
        carries(self.settings, request.namespace, request.name)
        return lock_key(request.namespace, request.name), comment(request, token)

    def begin(self, session: Session, attempt: Try) -> bool:
        """Register a shared or take-over request (`Modes.begin`)."""
        return self.modes.begin(session, attempt)

    def reusable(self, session: Session, attempt: Try) -> bool:
        """Whether *session* holds nothing: not a taker's stop request."""
        return reusable(session, attempt)


class Statements:
    """The semaphore's statements on GET_LOCK."""

    def __init__(self, server: Server, modes: Modes, holding: Holding[Session]) -> None:
        """Work on *server*'s sessions; a grant's lease holds with *holding*."""
        self.server = server
        self.modes = modes
        self.holding = holding

    def open(self, attempt: Try) -> Session:  # noqa: ARG002 - all alike
        """Open a session."""
        return self.server.session()

    def revive(self, session: Session, attempt: Try) -> bool:  # noqa: ARG002 - all alike
        """Forget what an earlier acquisition left on a kept *session*; False if it ended."""
        session.unchecked = session.gate_left = session.drawn = session.tried = None
        return bool(session.connection.open) and quiet(session)

    def lock(self, session: Session, part: int | str, seconds: float | None, attempt: Try) -> bool:
        """One GET_LOCK (never a negative timeout, docs/design.md P20).

        A one-slot lock's GET_LOCK draws the grant in the same round trip
        (`records.try_drawing`), its first try and its wait in the queue alike; a first try
        that finds the lock busy has read who uses it with another N too. Where that check
        is still due (`refuse_mismatch`), the next try goes at once, with the check in the
        same round trip, and waits in the queue only if the lock is busy. A shared request
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
                raise cancelled(self.server.where, part)
            if got == 1 or seconds == 0:
                return bool(got == 1)
        if self._draws_ahead(session, part, attempt):
            limit, patience = self.server.wait_limits(seconds)
            tried = try_drawing(self.server, session, attempt, limit, patience)
            if tried.got is None:  # KILL QUERY from outside
                raise cancelled(self.server.where, part)
            session.drawn = None if tried.drawn is None else (attempt, tried.drawn)
            if tried.checked:
                session.tried = (attempt, tried.other)
            return bool(tried.got == 1)
        return self.server.get(session, lock, seconds, attempt, part)

    def _draws_ahead(self, session: Session, part: int | str, attempt: Try) -> bool:
        """Whether this GET_LOCK of a one-slot lock may carry its grant (one round trip)."""
        return (
            part == 0 and attempt.slots == 1 and session.batches and self.server.tables is not False
        )

    def first_free(self, session: Session, attempt: Try) -> int:
        """Take the first free slot in one statement (with the check of N, if one is due)."""
        statement = first_free(attempt.key, attempt.slots)
        if session.unchecked is not attempt:
            return int(session.one(statement))
        session.unchecked = None
        return int(checked(session, attempt, statement, lambda slot: slot_lock(attempt.key, slot)))

    def refuse_mismatch(self, session: Session, attempt: Try) -> None:
        """Have *attempt*'s next try on *session* refuse a live holder of another N.

        A one-slot lock's first try read it already, where it found the lock busy
        (`lock`). Else the check goes in the next try's round trip (`records.checked`),
        before any wait in the queue; without the tables there is nothing to check. A
        shared request checked already, with its first try (`Modes.enter_shared`).
        """
        session.gate_left = None
        tried, session.tried = session.tried, None
        if tried is not None and tried[0] is attempt:
            session.unchecked = None
            if tried[1] is not None:
                raise mismatch(attempt.request, tried[1])
            return
        checks = self.server.tables is not False and not reading(attempt)
        session.unchecked = attempt if checks else None

    def ask(self, session: Session, slot: int, seconds: float, attempt: Try) -> None:
        """Send a GET_LOCK of *slot*, not waiting for the answer."""
        session.send(get_lock(f"{attempt.key}:{slot}", seconds, attempt.tag))

    def answer(self, session: Session, slot: int) -> bool:
        """Read `ask`'s answer, which is on its way (the socket is readable)."""
        got = session.receive()
        if got is None:
            raise cancelled(self.server.where, slot)
        return bool(got == 1)

    def cancel(self, winner: Session, sessions: Sequence[Session]) -> None:
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

    def grant(self, session: Session, attempt: Try, slot: int) -> MySQLLease | None:
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
            return MySQLLease(self.holding, session, f"{key}:{mark}", 0, None, attempt, None, mark)
        ahead, session.drawn = session.drawn, None
        if ahead is not None and ahead[0] is attempt:
            drawn: Drawn = ahead[1]
            if drawn.stale:  # the lease runs from this proof (a lost session raises)
                attempt.proved = now()
                if session.one(OURS, (f"{key}:{slot}",)) != 1:
                    raise cancelled(self.server.where, slot)
        else:
            drawn = draw(self.server, self.modes, session, attempt, slot)
        lock = f"{key}:{slot}"
        if drawn.other is not None:  # leave no row behind, and the slot free; the caller hangs up
            with contextlib.suppress(pymysql.err.Error):
                forget = Batch()
                forget.add(FORGET, (key, slot))
                forget.add("SELECT RELEASE_LOCK(%s)", (lock,))
                session.run(forget)
            raise mismatch(attempt.request, drawn.other)
        found = drawn.found if drawn.found is not None else self.modes.look(session, attempt)
        if not self.modes.settle(session, attempt, lock, found):
            session.one("SELECT RELEASE_LOCK(%s)", (lock,))
            return None
        return MySQLLease(self.holding, session, lock, slot, drawn.fence, attempt, drawn.record)

    def release_gate(self, session: Session, attempt: Try) -> None:
        """RELEASE_LOCK the gate, unless the grant's round trip let it go after the fence."""
        if session.gate_left is attempt:
            session.gate_left = None
            return
        session.one("SELECT RELEASE_LOCK(%s)", (f"{attempt.key}:{GATE}",))

    def end(self, sessions: Sequence[Session]) -> None:
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
