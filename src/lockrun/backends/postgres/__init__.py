"""PostgreSQL: session advisory locks as a first-in first-out semaphore (psycopg 3).

docs/design.md A6 and A8 give the reasons behind this design.

Keys are signed 64-bit: the first 8 bytes, big-endian, of SHA-256(namespace NUL name NUL
part), where part is ``0`` … ``N-1`` for the slots and ``gate`` for the queue of a
semaphore (never ``hashtext``: 32 bits collide); `keys` derives them.

The semaphore is `lockrun.backends.sessionlock`'s, on pg_advisory_lock (`ports`, `lease`,
composed by `backend`): the server grants in arrival order, and one ``lock_timeout`` bounds
a wait (asking again would put us at the back of the queue; ``--wait forever`` sets none;
`waiting`). The head of a semaphore's queue terminates its losing helper sessions with
pg_terminate_backend.

A slot lives with its session (`session`, opened by `server`): the server frees it when the
connection ends, or once the session idled for its ``idle_session_timeout``, which is the
lease. The holder proves ownership in pg_locks every ttl/3 and never reconnects (no pools,
docs/design.md P19). Every holder also takes the shared int-pair lock (hash32(namespace NUL
name), N), which tells users of another N apart (`grant`). Statements carry a
``/* lockrun {json} */`` comment naming who runs them, which `lockrun status` reads back
from pg_stat_activity (`status`; `rows` decodes what it reads).

The modes (`modes`): --shared takes the slot's key in ShareLock mode (one queue with the
writers); --hold-at-least leaves a row in the table ``lockrun_holds``, made on first use,
that every one-slot grant reads; --take-over holds the name's ``stop`` key while it waits
and NOTIFYs the holders, which LISTEN from their grant (docs/design.md A8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockrun.timing import DEFAULT_TTL

from .backend import PostgresBackend
from .keys import STOP, lock_key, slots_key
from .server import WINDOWS
from .session import PgError, Session
from .uri import Settings, parse

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.uri import LockURI

__all__ = [
    "STOP",
    "WINDOWS",
    "PgError",
    "PostgresBackend",
    "Session",
    "Settings",
    "connect",
    "lock_key",
    "parse",
    "slots_key",
]


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> PostgresBackend:
    """Check *uri*; sessions are opened on use, with timeouts that fit leases of *ttl*."""
    return PostgresBackend(
        parse(uri), ttl or DEFAULT_TTL, warn or (lambda _line: None), note or (lambda _line: None)
    )
