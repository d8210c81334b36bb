"""MySQL and MariaDB: the session-lock semaphore composed of GET_LOCK's ports, and `status`.

The semaphore is `lockrun.backends.sessionlock`'s (docs/design.md A6), given `ports`'s
statements, requests and faults and `lease`'s statements on a held slot.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from lockrun.backends.mysql.lease import Leases
from lockrun.backends.mysql.modes import Mode, Modes
from lockrun.backends.mysql.ports import Faults, Requests, Statements
from lockrun.backends.mysql.session import Server, Session
from lockrun.backends.mysql.status import read_states
from lockrun.backends.mysql.uri import Settings, carries, parse
from lockrun.backends.sessionlock import Holding, Idle, SessionBackend, SessionLocks, cancelled
from lockrun.timing import DEFAULT_TTL

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import LockState
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


class MySQLBackend(SessionBackend[Session, str, Mode]):
    """Sessions on one MySQL or MariaDB server."""

    def __init__(self, settings: Settings, ttl: float, note: Callable[[str], None]) -> None:
        """Remember *settings*; *note* gets what `-v` shows (no fence, and why)."""
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.server = Server(settings, ttl, note, functools.partial(cancelled, settings.where))
        self.timeout = self.server.timeout
        self.modes = Modes(self.server)
        faults = Faults(self.server)
        holding = Holding(Leases(self.modes, ttl), faults, Idle[Session](ttl, faults.errors), ttl)
        self.locks = SessionLocks[Session, str, Mode](
            Statements(self.server, self.modes, holding),
            Requests(settings, self.modes),
            holding,
            self.timeout,
        )

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        carries(self.settings, namespace, name)
        return read_states(self.server, namespace, name)
