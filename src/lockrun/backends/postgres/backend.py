"""PostgreSQL: the session-lock semaphore composed of pg_advisory_lock's ports, and `status`.

The semaphore is `lockrun.backends.sessionlock`'s (docs/design.md A6, A8), given `ports`'s
statements, requests and faults and `lease`'s statements on a held slot; `status` is
`status`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockrun.backends.sessionlock import Holding, Idle, SessionLocks

from .grant import Ahead
from .keys import Keys
from .lease import Leases
from .ports import Faults, Requests, Statements
from .server import Server
from .session import PgError, Session
from .status import states

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import LockState, Request
    from lockrun.backends.sessionlock import SessionLease

    from .uri import Settings


class PostgresBackend:
    """Sessions on one PostgreSQL server (or a pooler in session mode)."""

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        warn: Callable[[str], None],
        note: Callable[[str], None],
    ) -> None:
        """Remember *settings*; *warn* and *note* get one-line remarks (stderr, -v)."""
        self.server = Server(settings, ttl, warn, note)
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.timeout = self.server.timeout
        self.faults = Faults(self.server)
        kept = Idle[Session](ttl, self.faults.errors)
        holding = Holding(Leases(self.server), self.faults, kept, ttl)
        self.locks = SessionLocks[Session, Keys, Ahead](
            Statements(self.server, holding), Requests(), holding, self.timeout
        )

    def acquire(self, request: Request, deadline: float | None) -> SessionLease[Session] | None:
        """Wait in the server's queue until a slot is ours, or *deadline* passes."""
        return self.locks.acquire(request, deadline)

    def interrupt(self) -> None:
        """From another thread: end the waits of `acquire` at once (`SessionLocks.interrupt`)."""
        self.locks.interrupt()

    def close(self) -> None:
        """Close the kept session; held leases are released by their own `release`."""
        self.locks.idle.close()

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        session = self.server.session()
        try:
            return states(self.server, session, namespace, name)
        except PgError as err:
            raise self.faults.failure(err) from err
        finally:
            session.close()
