"""MySQL's lease of a slot: proven with ``IS_USED_LOCK(slot) = CONNECTION_ID()``, given back.

The holder proves ownership every ttl/3 and never reconnects: a session that failed once
has lost its locks (docs/design.md P19).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from lockrun.backends.mysql.batch import Batch
from lockrun.backends.mysql.modes import HOLD_OPTION
from lockrun.backends.mysql.session import STATEMENT_ERRORS, Session, tableless
from lockrun.backends.mysql.statements import MAX_HOLD_US, STOP, UNMARK, WINDOW
from lockrun.backends.sessionlock import SessionLease
from lockrun.errors import ConfigError, TakenOver

if TYPE_CHECKING:
    from lockrun.backends.mysql.modes import Mode, Modes
    from lockrun.backends.sessionlock import Attempt, Holding


class MySQLLease(SessionLease[Session]):
    """A slot (or a shared hold) of a session, with what a hold window or a take-over needs."""

    def __init__(
        self,
        holding: Holding[Session],
        session: Session,
        key: str,
        slot: int,
        fence: int | None,
        attempt: Attempt[Session, str, Mode],
        record: str | None,
        mark: str | None = None,
    ) -> None:
        """Describe *key* (slot *slot*, or the shared holder *mark*) held for *attempt*."""
        super().__init__(holding, session, key, slot, fence)
        self.base: str = attempt.key  # the lock's key without its part: KEY:stop is beside
        self.request = attempt.request
        self.record = record  # the holder's JSON, which a hold window keeps for `status`
        self.mark = mark  # a shared holder's row in lockrun_marks
        self.taker: object = None  # the session whose take-over `taken` names


class Leases:
    """The statements on a lease's session: the check, the release, a hold window."""

    def __init__(self, modes: Modes, ttl: float) -> None:
        """Check leases of *ttl*; *modes* names a taker and writes a hold window."""
        self.modes = modes
        self.ttl = ttl

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

    def cut(self, lease: SessionLease[Session]) -> bool:
        """Hang up at once under a refresh that hangs, and leave the session be."""
        lease.session.abandon()
        return False
