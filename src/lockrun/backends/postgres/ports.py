"""PostgreSQL's ports of the session-lock semaphore: advisory lock statements, requests, faults.

The order of things is `lockrun.backends.sessionlock.SessionLocks`'s (docs/design.md A6,
A8); these give it pg_advisory_lock. The modes are `modes`'s, the grant's round trip
`grant`'s.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Final

from psycopg import pq

from lockrun.backends.sessionlock import GATE, cancelled, quiet
from lockrun.errors import LockrunError
from lockrun.timing import now

from . import grant, modes, waiting
from .keys import Keys, application_name, comment
from .lease import Lease
from .rows import Others
from .session import QUERY_CANCELED, PgError, transient

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lockrun.backends import Request
    from lockrun.backends.sessionlock import Attempt, Holding

    from .grant import Ahead
    from .server import Server
    from .session import Session

    Try = Attempt[Session, Keys, Ahead]

_KEPT_KEYS: Final = 64  # names whose keys a backend keeps derived


class Faults:
    """psycopg's and libpq's errors (`PgError`), judged and said without a password."""

    errors: tuple[type[Exception], ...] = (PgError,)
    waits = "pg_advisory_lock"

    def __init__(self, server: Server) -> None:
        """Judge the errors of *server*'s sessions."""
        self.server = server
        self.where = server.settings.where

    def failure(self, err: Exception) -> LockrunError:
        """Translate a failure into one line, naming the server but no password."""
        assert isinstance(err, PgError)  # noqa: S101 - our `errors` are
        return self.server.failure(err)

    def passing(self, err: BaseException) -> bool:
        """Whether *err* is a lost connection a queued waiter may ride out."""
        return transient(err)

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is pg_cancel_backend's or a statement timeout's (57014)."""
        return isinstance(err, PgError) and err.sqlstate == QUERY_CANCELED

    def said(self, err: Exception) -> str:
        """Return the server's or libpq's words for *err*, in one line, without a password."""
        return self.server.said(err)


class Requests:
    """A request's advisory keys and comment; the modes register nothing before a try."""

    def __init__(self) -> None:
        """Derive each name's keys once: a kept Lock asks for the same ones every time."""
        self.keys: dict[tuple[str, str, int], Keys] = {}

    def names(self, request: Request, token: str) -> tuple[Keys, str]:
        """Return *request*'s keys (its slots, gate, stop) and the waiter's comment."""
        which = (request.namespace, request.name, request.slots)
        keys = self.keys.get(which)
        if keys is None:
            if len(self.keys) >= _KEPT_KEYS:
                self.keys.clear()
            keys = self.keys[which] = Keys(*which)
        return keys, comment(request, token, request.holder)

    def begin(self, session: Session, attempt: Try) -> bool:  # noqa: ARG002 - nothing to register
        """Register nothing: a taker asks to stop with its wait (`waiting.queue`)."""
        return True

    def reusable(self, session: Session, attempt: Try) -> bool:  # noqa: ARG002 - all are
        """Whether *session* may be kept: it holds nothing once its wait ended."""
        return True


class Statements:
    """The semaphore's statements on pg_advisory_lock."""

    def __init__(self, server: Server, holding: Holding[Session]) -> None:
        """Work on *server*'s sessions; a grant's lease holds with *holding*."""
        self.server = server
        self.holding = holding
        self.where = server.settings.where
        self.timeout = server.timeout

    def open(self, attempt: Try) -> Session:
        """Open a session that names *attempt*'s waiter."""
        return self.server.session(attempt.tag, application_name(attempt.request.name, "waiting"))

    def revive(self, session: Session, attempt: Try) -> bool:
        """Check a kept session, and have it carry *attempt*'s comment from now on.

        A kept session may still listen where a try or a grant of its asked (`grant.draw`):
        a NOTIFY read there is no goodbye. Anything else is, or libpq finds the connection
        gone. A session that holds the (name, N) lock of another name or N is not kept.
        """
        session.tag = attempt.tag
        if session.agreed not in {None, grant.agreement(attempt)}:
            return False  # it holds another name's (name, N) lock: closed, which frees it
        try:
            session.ready()
        except PgError:
            return False
        session.heard()
        return session.pgconn.status == pq.ConnStatus.OK and quiet(session)

    def lock(self, session: Session, part: int | str, seconds: float | None, attempt: Try) -> bool:
        """One pg_advisory_lock bounded by lock_timeout (none for ever), or one try.

        A taker holds the name's stop key while it waits (committed before the wait, so
        holders see it); a one-slot wait that got the slot draws its grant and looks for
        a --hold-at-least window in the same round trip (`grant.wait_and_grant`,
        docs/design.md A8): a window that outlasts the deadline is `Outlasted`, busy.
        """
        key = attempt.key.gate if part == GATE else attempt.key.slots[int(part)]
        if attempt.request.hold and not self.server.windows:
            modes.make_windows(self.server, session, attempt.request.name)
        if seconds == 0 and attempt.slots == 1 and grant.queues_at_once(session, attempt):
            # contended last time: the try rides in the wait's statement, one round trip
            deadline = attempt.deadline
            seconds = None if deadline is None else max(0.0, deadline - now())
        elif seconds == 0 and attempt.slots == 1:
            return grant.try_and_grant(self.server, session, attempt)
        if seconds == 0:
            tried = session.one(
                "SELECT pg_try_advisory_lock($1::bigint)", key, timeout=self.timeout
            )
            return tried == "t"
        if attempt.slots == 1:  # the grant rides in the wait's message
            got, error = grant.wait_and_grant(self.server, session, seconds, attempt)
            if got:
                return True
        else:
            answers, error = waiting.queue(self.server, session, key, part, seconds, attempt)
            if answers:
                return True
        modes.give_up(self.server, session, attempt, error)
        return waiting.ran_out(error, cancelled(self.where, part))

    def first_free(self, session: Session, attempt: Try) -> int:
        """Take the first free slot in one statement; -1 if none is."""
        return int(session.one(waiting.first_free(attempt.key), timeout=self.timeout) or -1)

    def refuse_mismatch(self, session: Session, attempt: Try) -> None:
        """Raise `ConfigError` if a live holder of the name uses another N.

        A one-slot try ran the check already, in its round trip (`grant.try_and_grant`).
        """
        if attempt.state is not None:
            found = attempt.state.others
            attempt.state = None
        else:
            session.send_simple(grant.others(attempt.key, attempt.slots))
            found = Others.read(session.receive(self.timeout))
        grant.judge(found, attempt.request)

    def ask(self, session: Session, slot: int, seconds: float, attempt: Try) -> None:
        """Send a wait of up to *seconds* for *slot*, not waiting for the answer."""
        session.send_simple(waiting.wait_for(seconds, attempt.key.slots[slot]))

    def answer(self, session: Session, slot: int) -> bool | None:
        """Read `ask`'s answer: True if *slot* is ours; None if it is not all in yet."""
        if not session.ready():
            return None
        try:
            # The result is in, but libpq is busy until ReadyForQuery follows it, which
            # may come in a later packet: it is on its way, wait for it (it was 69).
            session.receive(self.timeout)
        except PgError as err:
            return waiting.ran_out(err, cancelled(self.where, slot))
        return True

    def cancel(self, winner: Session, sessions: Sequence[Session]) -> None:
        """From *winner*, end the other sessions' waits, and any slot they got meanwhile.

        Helpers are terminated. The first session keeps the gate until the grant is done,
        so only its statement is cancelled: it then fails, or holds slot 0 too, which
        closing it after the grant frees.
        """
        first, *helpers = sessions
        losers = [helper for helper in helpers if helper is not winner]
        if losers:
            waiting.terminate(winner, [loser.pid for loser in losers], self.timeout)
            for loser in losers:
                loser.abandon()
        if first is not winner:
            waiting.cancel_first(self.server, winner, first)

    def grant(self, session: Session, attempt: Try, slot: int) -> Lease:
        """Draw a fence, name the session, take the shared (name, N) lock, check N.

        One round trip (`grant.draw`), unless the try that got the slot drew it already.
        A take-over asked by someone who waits behind us is obeyed at once: the slot goes
        back and `TakenOver` is raised (docs/semantics.md "Take-over").
        """
        lease = Lease(self.holding, session, attempt.key, slot, attempt)
        try:
            if attempt.sent is None or attempt.state is None:
                grant.name(session, attempt, slot)
                _, ahead, _ = grant.draw(self.server, session, attempt, slot, trying=False)
            else:  # the try drew it (`grant.try_and_grant`)
                ahead = attempt.state
            lease.holder = session.holder or lease.holder
            lease.fence = ahead.fence
            kept, session.agreed = session.agreed, None
            grant.judge(ahead.others, attempt.request)
            modes.give_way(ahead.others.stops, lease)
            if attempt.slots == 1 and not session.tangled and (ahead.checked or kept):
                session.agreed = grant.agreement(attempt)  # kept: no check on its next try
        except BaseException:
            lease.release()
            raise
        modes.ring(lease)
        return lease

    def release_gate(self, session: Session, attempt: Try) -> None:
        """Let the gate go; the session keeps its slot."""
        session.rows(
            "SELECT pg_advisory_unlock($1::bigint)", attempt.key.gate, timeout=self.timeout
        )

    def end(self, sessions: Sequence[Session]) -> None:
        """Terminate server sessions we hung up on, so their waits leave the queue now.

        A waiting server session notices a hang-up only at its next client check (a
        second on 14+, else when granted); an interrupted waiter should leave nothing.
        """
        pids = [session.pid for session in sessions if session.pid]
        if not pids:
            return
        with contextlib.suppress(LockrunError, PgError):
            session = self.server.session()
            try:
                waiting.terminate(session, pids, self.timeout)
            finally:
                session.close()
