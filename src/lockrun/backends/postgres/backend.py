"""PostgreSQL: the session-lock semaphore composed of pg_advisory_lock's ports, and `status`.

The semaphore is `lockrun.backends.sessionlock`'s (docs/design.md A6, A8), given `ports`'s
statements, requests and faults and `lease`'s statements on a held slot; `status` is
`status`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockrun.backends.sessionlock import Holding, Idle, SessionBackend, SessionLocks

from .grant import Ahead
from .keys import Keys
from .lease import Leases
from .ports import Faults, Requests, Statements
from .server import Server
from .session import PgError, Session
from .status import states

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import LockState

    from .uri import Settings


class PostgresBackend(SessionBackend[Session, Keys, Ahead]):
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
        idle = Idle[Session](ttl, self.faults.errors)
        holding = Holding(Leases(self.server), self.faults, idle, ttl)
        self.locks = SessionLocks[Session, Keys, Ahead](
            Statements(self.server, holding), Requests(), holding, self.timeout
        )

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        session = self.server.session()
        try:
            return states(self.server, session, namespace, name)
        except PgError as err:
            raise self.faults.failure(err) from err
        finally:
            session.close()
