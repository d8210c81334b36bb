"""PostgreSQL's side of the session-lock semaphore: the hooks `SessionLockBackend` calls.

The semaphore is `lockrun.backends.sessionlock`'s, on pg_advisory_lock (docs/design.md A6,
A8); the modes are `modes`'s, the grant's round trip `grant`'s, `status` is `status`'s.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Final

from psycopg import pq

from lockrun.backends.sessionlock import GATE, Attempt, SessionLease, SessionLockBackend
from lockrun.errors import LockrunError

from . import grant, modes, waiting
from .keys import Keys, application_name, comment, halves
from .rows import Check, Others
from .server import Server
from .session import QUERY_CANCELED, NoAnswer, PgError, Session, transient
from .status import states

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import psycopg

    from lockrun.backends import LockState, Request
    from lockrun.errors import ConfigError

    from .uri import Settings

_REFRESH_GONE: Final = 1.0  # s: a refresh cut off by a release ends within this


class Lease(SessionLease[Session]):
    """A slot of a PostgreSQL session: what a take-over check and a window need to know."""

    def __init__(
        self,
        backend: PostgresBackend,
        session: Session,
        keys: Keys,
        slot: int,
        attempt: Attempt[Session],
    ) -> None:
        """Describe *slot* of *keys*, just granted to *session* for *attempt*."""
        super().__init__(backend, session, keys.slots[slot], slot, None)
        self.keys = keys
        self.token = attempt.token
        self.names = (attempt.request.namespace, attempt.request.name)
        self.request = attempt.request
        self.holder = attempt.request.holder  # as the grant named it: a window's row keeps it
        self.hold = 0.0  # --hold-at-least: seconds the slot stays taken after release
        self.refused: ConfigError | None = None  # a window that could not be written

    def release(self, hold: float = 0.0) -> bool:
        """Give the slot back, leaving a window of *hold* seconds if that is asked.

        A window that could not be written is a `ConfigError` (78), raised once the slot
        is free: the slot is never left held for want of a table.
        """
        if not self.released:
            self.hold = hold
        heard = super().release(hold)
        bells, self.bells = self.bells, ()
        for bell in bells:
            os.close(bell)
        refused, self.refused = self.refused, None
        if refused is not None:
            raise refused
        return heard


class PostgresBackend(SessionLockBackend[Session]):
    """Sessions on one PostgreSQL server (or a pooler in session mode)."""

    errors = (PgError,)
    waits = "pg_advisory_lock"

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        warn: Callable[[str], None],
        note: Callable[[str], None],
    ) -> None:
        """Remember *settings*; *warn* and *note* get one-line remarks (stderr, -v)."""
        super().__init__()
        self.server = Server(settings, ttl, warn, note)
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.timeout = self.server.timeout

    def failure(self, err: psycopg.Error | PgError) -> LockrunError:
        """Translate a failure into one line, naming the server but no password."""
        return self.server.failure(err)

    # -- acquiring -----------------------------------------------------------------------

    def _passing(self, err: BaseException) -> bool:
        return transient(err)

    def _key(self, request: Request) -> Keys:
        return Keys(request.namespace, request.name, request.slots)

    def _tag(self, request: Request, token: str) -> str:
        return comment(request, token, request.holder)

    def _session(self, attempt: Attempt[Session]) -> Session:
        return self.server.session(attempt.tag, application_name(attempt.request.name, "waiting"))

    def _revive(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Check a kept session, and have it carry *attempt*'s comment from now on.

        A kept session may still listen where a try of its asked (`grant.draw`): a NOTIFY
        read there is no goodbye. Anything else is, or libpq finds the connection gone.
        """
        session.tag = attempt.tag
        try:
            session.ready()
        except PgError:
            return False
        session.heard()
        return session.pgconn.status == pq.ConnStatus.OK and super()._revive(session, attempt)

    def _end(self, sessions: Sequence[Session]) -> None:
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

    def _take(self, attempt: Attempt[Session]) -> tuple[int, Session | None]:
        """As any session lock; a window that outlasts the deadline ends the wait, busy."""
        try:
            return super()._take(attempt)
        except modes.Outlasted:
            return -1, None

    def _lock(
        self, session: Session, part: int | str, seconds: float | None, attempt: Attempt[Session]
    ) -> bool:
        """One pg_advisory_lock bounded by lock_timeout (none for ever), or one try.

        A taker holds the name's stop key while it waits (committed before the wait, so
        holders see it); a one-slot wait that got the slot looks for a --hold-at-least
        window in the same round trip (docs/design.md A8).
        """
        key = attempt.key.gate if part == GATE else attempt.key.slots[part]
        if attempt.request.hold and not self.server.windows:
            modes.make_windows(self.server, session, attempt.request.name)
        if seconds == 0 and attempt.slots == 1:
            return grant.try_and_grant(self.server, session, attempt)
        if seconds == 0:
            got = session.one("SELECT pg_try_advisory_lock($1::bigint)", key, timeout=self.timeout)
            return got == "t"
        answers, error = waiting.queue(self.server, session, key, part, seconds, attempt)
        if not answers:  # the wait itself failed
            modes.give_up(self.server, session, attempt, error)
            return waiting.ran_out(error, self._cancelled(part))
        if attempt.slots == 1:
            window = modes.read_window(self.server, session, key, answers[1:], error)
            if window is not None:
                modes.sit_out(self.server, session, attempt, window)
        return True

    def _first_free(self, session: Session, attempt: Attempt[Session]) -> int:
        return int(session.one(waiting.first_free(attempt.key), timeout=self.timeout) or -1)

    def _ask(self, session: Session, slot: int, seconds: float, attempt: Attempt[Session]) -> None:
        session.send_simple(waiting.wait_for(seconds, attempt.key.slots[slot]))

    def _answer(self, session: Session, slot: int) -> bool | None:
        if not session.ready():
            return None
        try:
            # The result is in, but libpq is busy until ReadyForQuery follows it, which
            # may come in a later packet: it is on its way, wait for it (it was 69).
            session.receive(self.timeout)
        except PgError as err:
            return waiting.ran_out(err, self._cancelled(slot))
        return True

    def _release_gate(self, session: Session, attempt: Attempt[Session]) -> None:
        session.rows(
            "SELECT pg_advisory_unlock($1::bigint)", attempt.key.gate, timeout=self.timeout
        )

    def _cancel(self, winner: Session, sessions: Sequence[Session]) -> None:
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

    def _grant(self, session: Session, attempt: Attempt[Session], slot: int) -> Lease:
        """Draw a fence, name the session, take the shared (name, N) lock, check N.

        One round trip (`grant.draw`), unless the try that got the slot drew it already.
        A take-over asked by someone who waits behind us is obeyed at once: the slot goes
        back and `TakenOver` is raised (docs/semantics.md "Take-over").
        """
        lease = Lease(self, session, attempt.key, slot, attempt)
        try:
            if attempt.sent is None:
                grant.name(session, attempt, slot)
                _, ahead, _ = grant.draw(self.server, session, attempt, slot, trying=False)
            else:  # the try drew it (`grant.try_and_grant`)
                ahead = attempt.ahead
            lease.holder = session.holder or lease.holder
            lease.fence = ahead.fence
            grant.judge(ahead.others, attempt.request)
            modes.give_way(ahead.others.stops, lease)
        except BaseException:
            lease.release()
            raise
        modes.ring(lease)
        return lease

    def _refuse_mismatch(self, session: Session, attempt: Attempt[Session]) -> None:
        """Raise `ConfigError` if a live holder of the name uses another N.

        A one-slot try ran the check already, in its round trip (`grant.try_and_grant`).
        """
        if attempt.ahead is not None:
            found = attempt.ahead.others
            attempt.ahead = None
        else:
            session.send_simple(grant.others(attempt.key, attempt.slots))
            found = Others.read(session.receive(self.timeout))
        grant.judge(found, attempt.request)

    # -- holding -------------------------------------------------------------------------

    def holds(self, lease: SessionLease[Session]) -> bool:
        """Whether pg_locks still shows *lease*'s slot granted to its session.

        The same round trip looks for takers (`TakenOver`, the slot still ours): sessions
        that hold the name's stop key and wait (docs/design.md A8).
        """
        if not isinstance(lease, Lease):  # every lease of ours is one
            raise TypeError(lease)
        classid, objid = halves(lease.key)
        stop_class, stop_obj = halves(lease.keys.stop)
        session = lease.session
        heard = session.heard()  # what rang the bell: this check answers it
        for _ in range(2):
            session.send_simple(
                f"EXECUTE lockrun_check({classid}, {objid}, {stop_class}, {stop_obj})"
            )
            check = Check.read(session.receive(self.ttl))
            if not check.holds:
                return False
            modes.give_way(check.stops, lease, heard)
            # A NOTIFY read with the answer may have come after the check ran: ask again.
            heard = session.heard()
            if not heard:
                break
        return True

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is pg_cancel_backend's or a statement timeout's (57014)."""
        return isinstance(err, PgError) and err.sqlstate == QUERY_CANCELED

    def said(self, err: Exception) -> str:
        """Return the server's or libpq's words for *err*, in one line, without a password."""
        return self.server.said(err)

    def give_back(self, lease: SessionLease[Session]) -> None:
        """Unlock everything the session holds: the next waiter has it when this returns.

        With a --hold-at-least window to leave, its row is written and committed first, in
        the same round trip: whoever the unlock lets in reads it (`modes.read_window`). A
        window that cannot be written is refused (`Lease.release` raises 78), the slot
        freed all the same. Its application_name no longer names a slot: the session may
        be kept, idle.
        """
        if isinstance(lease, Lease) and lease.hold > 0:
            try:
                modes.leave_window(self.server, lease)
            except PgError as err:
                if isinstance(err, NoAnswer) or err.sqlstate is None:
                    raise
                lease.refused = modes.window_refused(self.server, lease, err)
            else:
                return
        modes.give_back(self.server, lease.session)

    def hold_over(self, lease: SessionLease[Session], hold: float) -> None:  # noqa: ARG002
        """Leave the window `give_back` writes for a lease whose ``hold`` is set (`Lease`)."""
        self.give_back(lease)

    def cut(self, lease: SessionLease[Session]) -> bool:
        """Cut the connection under a hanging refresh; wait for that thread to leave libpq."""
        lease.session.hang_up()
        # Until the refresh thread is out of libpq's connection, leave the connection be.
        return lease.busy.acquire(timeout=_REFRESH_GONE)

    # -- status --------------------------------------------------------------------------

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        session = self.server.session()
        try:
            return states(self.server, session, namespace, name)
        except PgError as err:
            raise self.failure(err) from err
        finally:
            session.close()
