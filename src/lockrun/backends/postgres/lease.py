"""PostgreSQL's lease of a slot: proven in pg_locks every ttl/3, given back with its window.

The check looks for takers in the same round trip (docs/design.md A8); the release
leaves a --hold-at-least window first, in the same round trip (`modes.leave_window`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from lockrun.backends.sessionlock import SessionLease

from . import modes
from .keys import halves
from .rows import Check
from .session import NoAnswer, PgError, Session

if TYPE_CHECKING:
    from lockrun.backends.sessionlock import Attempt, Holding
    from lockrun.errors import ConfigError

    from .grant import Ahead
    from .keys import Keys
    from .server import Server

_REFRESH_GONE: Final = 1.0  # s: a refresh cut off by a release ends within this


class Lease(SessionLease[Session]):
    """A slot of a PostgreSQL session: what a take-over check and a window need to know."""

    def __init__(
        self,
        holding: Holding[Session],
        session: Session,
        keys: Keys,
        slot: int,
        attempt: Attempt[Session, Keys, Ahead],
    ) -> None:
        """Describe *slot* of *keys*, just granted to *session* for *attempt*."""
        super().__init__(holding, session, keys.slots[slot], slot, None)
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


class Leases:
    """The statements on a lease's session: the check with its takers, the release."""

    def __init__(self, server: Server) -> None:
        """Check and release leases of *server*'s sessions."""
        self.server = server

    def holds(self, lease: SessionLease[Session]) -> bool:
        """Whether pg_locks still shows *lease*'s slot granted to its session.

        The same round trip looks for takers (`TakenOver`, the slot still ours): sessions
        that hold the name's stop key and wait (docs/design.md A8).
        """
        if not isinstance(lease, Lease):  # every lease of ours is one
            raise TypeError(lease)
        classid, objid = halves(lease.keys.slots[lease.slot])
        stop_class, stop_obj = halves(lease.keys.stop)
        session = lease.session
        heard = session.heard()  # what rang the bell: this check answers it
        for _ in range(2):
            session.send_simple(
                f"EXECUTE lockrun_check({classid}, {objid}, {stop_class}, {stop_obj})"
            )
            check = Check.read(session.receive(self.server.ttl))
            if not check.holds:
                return False
            modes.give_way(check.stops, lease, heard)
            # A NOTIFY read with the answer may have come after the check ran: ask again.
            heard = session.heard()
            if not heard:
                break
        return True

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
        modes.give_back(self.server, lease.session, lease if isinstance(lease, Lease) else None)

    def hold_over(self, lease: SessionLease[Session], hold: float) -> None:  # noqa: ARG002
        """Leave the window `give_back` writes for a lease whose ``hold`` is set (`Lease`)."""
        self.give_back(lease)

    def cut(self, lease: SessionLease[Session]) -> bool:
        """Cut the connection under a hanging refresh; wait for that thread to leave libpq."""
        lease.session.hang_up()
        # Until the refresh thread is out of libpq's connection, leave the connection be.
        return lease.busy.acquire(timeout=_REFRESH_GONE)
