"""PostgreSQL fences: a counter per name in an unlogged table, seeded by the server's clock.

The fence is max(previous + 1, the server's clock in µs) (docs/semantics.md
"LOCKRUN_FENCE"), drawn in the grant's statement from the row of the name's slot-0 key in
``lockrun_fences``, made on first use. The table is UNLOGGED: its writes make no WAL, so
the grant's commit waits for no disk. A crash empties it, and so does a promotion (a
standby has no data of an unlogged table): the clock seeds the counter again, which keeps
fences rising as long as the server's clock does not step back. The fences of lockrun
before this table were transaction ids, far below any clock in µs.

Where the table cannot be made (a role without CREATE on the schema, a read-only
database), a fence is the id of the grant's transaction, made durable by a logical message
where that is allowed, as before; no clock fence was drawn there, as there is no table. A
grant of that kind reads whether the table exists since, and if so draws from it again.
Where it exists but this role may not write it, there is no fence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from lockrun.bounds import MAX_FENCE

from .session import DUPLICATE, NOT_ALLOWED, UNDEFINED_TABLE, results

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .server import Server
    from .session import PgError, Row, Session

FENCES: Final = "lockrun_fences"
CREATE_FENCES: Final = (
    f"CREATE UNLOGGED TABLE IF NOT EXISTS {FENCES} (key bigint PRIMARY KEY, fence bigint NOT NULL)",
    # Users of a name may log in as different roles: each must draw from the same counter.
    f"GRANT SELECT, INSERT, UPDATE ON {FENCES} TO PUBLIC",
)
_MICROS: Final = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
# Whether the table exists, under the statement's snapshot (a fallback grant's check).
MADE: Final = (
    "SELECT EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    f"WHERE c.relname = '{FENCES}' AND n.nspname = ANY (current_schemas(false)))"
)
_READ_ONLY: Final = "25006"  # read_only_sql_transaction

# What `Server.fences` says of the table.
TABLE: Final = "table"  # it exists: fences come from it
MAKE: Final = "make"  # not seen: the first grant that draws a fence makes it
XACT: Final = "xact"  # it cannot be made: fences are transaction ids
NONE: Final = "none"  # it exists, but this role may not write it: no fence


def draw(key: str) -> str:
    """Return the data-modifying WITH query that draws the fence of *key* if ``try.got``.

    A counter at or past 2^63 - 1 is one lockrun never wrote (fence + 1 would overflow):
    it counts as lost, and the clock seeds the fence again.
    """
    return (
        f"INSERT INTO {FENCES} AS f (key, fence) SELECT {key}, {_MICROS} FROM try WHERE got "
        f"ON CONFLICT (key) DO UPDATE SET fence = CASE WHEN f.fence >= {MAX_FENCE} "
        "THEN excluded.fence ELSE GREATEST(f.fence + 1, excluded.fence) END RETURNING f.fence"
    )


def make(server: Server, session: Session) -> None:
    """Make the table, once per backend where it was not seen; fall back if we cannot."""
    if server.fences != MAKE:
        return
    session.send_simple(*CREATE_FENCES)
    _, error = results(session, server.timeout)
    if error is None or error.sqlstate == DUPLICATE:  # a race with another maker
        server.fences = TABLE
        return
    server.fences = XACT
    server.note(
        f"{server.where}: fences are transaction ids: cannot make table {FENCES} "
        f"({server.said(error)}); docs/backends.md (PostgreSQL) says how to make it ahead"
    )


def made_since(server: Server, rows: Sequence[Row]) -> bool:
    """Whether a fallback grant's question (`MADE`) found the table: then draw from it."""
    if server.fences != XACT or list(rows) != [("t",)]:
        return False
    server.fences = TABLE
    return True


def refused(server: Server, error: PgError) -> bool:
    """Whether *error* refused the table to a grant: learn what to draw instead, note it."""
    if server.fences != TABLE:
        return False
    if error.sqlstate == UNDEFINED_TABLE:  # dropped: make it again
        server.fences = MAKE
        return True
    if error.sqlstate not in {*NOT_ALLOWED, _READ_ONLY}:
        return False
    server.fences = NONE
    server.note(
        f"{server.where}: no fence: cannot write table {FENCES} ({server.said(error)}); "
        "LOCKRUN_FENCE stays unset"
    )
    return True
