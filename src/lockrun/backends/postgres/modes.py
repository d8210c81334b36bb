"""PostgreSQL's modes: --hold-at-least windows in a table, --take-over by a stop key and LISTEN.

--hold-at-least leaves a row in the table ``lockrun_holds``, made on first use, that every
one-slot grant reads; --take-over holds the name's ``stop`` key while it waits and NOTIFYs
the holders, which LISTEN from their grant (docs/design.md A8). --shared needs no more than
the lock's mode (`waiting.wait_for`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from lockrun.backends import MAX_RECORD
from lockrun.backends.sessionlock import Outlasted
from lockrun.bounds import MAX_WAIT
from lockrun.errors import ConfigError, TakenOver
from lockrun.timing import now

from .keys import application_name, channel, identity
from .rows import Window, parse_window, taker
from .server import WINDOWS
from .session import DUPLICATE, LOCK_NOT_AVAILABLE, UNDEFINED_TABLE, PgError, results

if TYPE_CHECKING:
    from collections.abc import Sequence
    from collections.abc import Set as AbstractSet

    from lockrun.backends.sessionlock import Attempt

    from .grant import Ahead
    from .keys import Keys
    from .lease import Lease
    from .rows import StopRow
    from .server import Server
    from .session import Row, Session

CREATE_WINDOWS: Final = (
    (
        f"CREATE TABLE IF NOT EXISTS {WINDOWS} "
        "(key bigint PRIMARY KEY, until timestamptz NOT NULL, holder text NOT NULL)"
    ),
    # Users of a name may log in as different roles: each must see and write its windows.
    # Writing one is no more power than holding the lock, which any role may do.
    f"GRANT SELECT, INSERT, UPDATE, DELETE ON {WINDOWS} TO PUBLIC",
)
GIVE_BACK: Final = (
    "SELECT pg_advisory_unlock_all(), set_config('application_name', 'lockrun', false)"
)
UNLISTEN: Final = "UNLISTEN *"
# The open window of slot $1: seconds left, cut to MAX_WAIT (anyone may write the table).
WINDOW: Final = (
    f"SELECT extract(epoch FROM least(until, clock_timestamp() + interval "
    f"'{int(MAX_WAIT)} seconds') - clock_timestamp()) FROM {WINDOWS} "
    "WHERE key = $1 AND until > clock_timestamp() ORDER BY until DESC LIMIT 1"
)
_PREPARED_READ: Final = "prepared"  # Session.windowed: lockrun_window is
_BROKEN: Final = "inline"  # Session.windowed: a read failed; the next ones are not prepared


# -- --hold-at-least windows ---------------------------------------------------------------


def make_windows(server: Server, session: Session, name: str) -> None:
    """Make the table of windows before a --hold-at-least run; 78 now if this role cannot.

    Once per backend, where the table is missing: a window the release could not write
    would be a fleet's job run on every host, said only after it ran.
    """
    session.send_simple(*CREATE_WINDOWS)
    _, error = results(session, server.timeout)
    if error is not None and error.sqlstate != DUPLICATE:  # a race with another maker
        msg = (
            f"{name}: --hold-at-least needs table {WINDOWS} on {server.where}, which this "
            f"role cannot make ({server.said(error)}); "
            "docs/backends.md (PostgreSQL) says how to make it ahead"
        )
        raise ConfigError(msg)
    server.windows = True


def window_check(server: Server, session: Session, key: int) -> list[str]:
    """Return the statements that read the window of slot *key*, if the table exists.

    Where this backend has not seen the table, they ask whether the table exists now
    (made since our sessions began): `read_window` then reads it in a round trip of its own.
    They ask pg_class under the statement's snapshot: a cached "no such table" could be
    older than the unlock that let us in. The read is prepared on its session's first
    use (planning it costs more than running it); it cannot be before the table exists.
    """
    if not server.windows:
        return ["EXECUTE lockrun_table"]
    if session.windowed == _BROKEN:  # a failed read: whether it is prepared is unknown
        return [WINDOW.replace("$1", str(key))]
    prepare = [] if session.windowed else [f"PREPARE lockrun_window(bigint) AS {WINDOW}"]
    session.windowed = _PREPARED_READ
    return [*prepare, f"EXECUTE lockrun_window({key})"]


def read_window(
    server: Server,
    session: Session,
    key: int,
    answers: Sequence[list[Row]],
    error: PgError | None,
) -> Window | None:
    """Read `window_check`'s answer for a slot we hold; None if no window is open."""
    if error is not None or not answers:
        unreadable(server, session, error)
        return None
    rows = answers[0]
    if not server.windows:
        if rows != [("t",)]:
            return None
        server.windows = True
        session.send_simple(*window_check(server, session, key))
        answers, error = results(session, server.timeout)
        if error is not None or not answers:
            unreadable(server, session, error)
            return None
        rows = answers[0]
    return parse_window(rows)


def unreadable(server: Server, session: Session, error: PgError | None) -> None:
    """Say once that windows cannot be read (another role's table, or not lockrun's)."""
    session.windowed = _BROKEN  # a prepared statement outlives the failed transaction
    if error is not None and error.sqlstate == UNDEFINED_TABLE:
        server.windows = False  # dropped: none to respect
        return
    if not server.unreadable:
        server.unreadable = True
        said = "no answer" if error is None else server.said(error)
        server.warn(
            f"{server.where}: table {WINDOWS} cannot be read ({said}), so this run does "
            "not see --hold-at-least windows; docs/backends.md says how it is made"
        )


def sit_out(
    server: Server, session: Session, attempt: Attempt[Session, Keys, Ahead], window: Window
) -> None:
    """Wait out *window* on the slot just taken, keeping it (and so our place in line).

    A deadline that comes first is busy at once: the slot is given back to the next in
    line (`Outlasted`). Otherwise the session sleeps on the server: a running statement
    is no idle session, so its lease (idle_session_timeout) does not end it, and a
    lockrun that dies meanwhile is noticed by client_connection_check_interval.
    """
    deadline = attempt.deadline
    if deadline is not None and now() + window.remaining > deadline:
        give_back(server, session)
        raise Outlasted
    session.tag = attempt.tag  # a waiter's, for status, until the grant names the holder
    waiting = session.literal(application_name(attempt.request.name, "waiting"))
    session.rows(
        f"SELECT set_config('application_name', {waiting}, false), "
        f"pg_sleep({window.remaining:.6f})",
        timeout=window.remaining + server.timeout,
    )


def leave_window(server: Server, lease: Lease, *, again: bool = True) -> None:
    """Write *lease*'s window (now + hold, by the server's clock), commit, unlock: one trip.

    The table is made on first use. Rows of windows that ended go in the same
    transaction, so the table holds about one row per window open.
    """
    session = lease.session
    # The whole record (its command line cut at about 1 kB), not the comment's part.
    record = identity(lease.request, lease.token, lease.holder, room=MAX_RECORD // 2)
    statements = [] if server.windows else list(CREATE_WINDOWS)
    statements += [
        # Rows another session is busy with are left to it: this waits for nobody.
        (
            f"DELETE FROM {WINDOWS} WHERE key IN (SELECT key FROM {WINDOWS} "
            "WHERE until < clock_timestamp() LIMIT 100 FOR UPDATE SKIP LOCKED)"
        ),
        (
            f"INSERT INTO {WINDOWS} (key, until, holder) VALUES ({lease.key}, "
            f"clock_timestamp() + make_interval(secs => {lease.hold:.6f}), "
            f"{session.literal(record)}) ON CONFLICT (key) DO UPDATE "
            "SET until = excluded.until, holder = excluded.holder"
        ),
        "COMMIT",
        UNLISTEN,
        GIVE_BACK,
    ]
    session.send_simple(*statements)
    try:
        session.answers(server.timeout)
    except PgError as err:
        if again and err.sqlstate == DUPLICATE and not server.windows:
            leave_window(server, lease, again=False)  # made by another session meanwhile
            return
        raise
    server.windows = True
    forget(session)
    session.heard()


def window_refused(server: Server, lease: Lease, err: PgError) -> ConfigError:
    """Return the 78 of a window this role could not write (the server refused *err*)."""
    return ConfigError(
        f"{lease.names[1]}: --hold-at-least needs table {WINDOWS} on {server.where}, which "
        f"this role cannot write ({server.said(err)}); "
        "the lock was released at once (docs/backends.md, PostgreSQL)"
    )


def give_back(server: Server, session: Session, lease: Lease | None = None) -> None:
    """Unlock all that *session* holds (slot, gate, stop key); it then hears nothing.

    A session that keeps its (name, N) lock (`Session.agreed`) unlocks *lease*'s slot
    alone, and listens on: its next grant needs neither the check of N nor a LISTEN.
    """
    if lease is not None and session.agreed is not None and not session.tangled:
        unlock = "pg_advisory_unlock_shared" if lease.request.shared else "pg_advisory_unlock"
        release = f"SELECT {unlock}($1), set_config('application_name', 'lockrun', false)"
        session.send_simple(*session.prepared(release, "bigint", str(lease.key)))
        if session.answers(server.timeout)[0][0][0] == "t":
            return
    session.send_simple(*([UNLISTEN] if session.listening else []), GIVE_BACK)
    session.answers(server.timeout)
    forget(session)
    session.heard()


def forget(session: Session) -> None:
    """Note that *session* holds no lock and listens nowhere (pg_advisory_unlock_all)."""
    session.stopping, session.listening = False, ""
    session.agreed, session.tangled = None, False


# -- --take-over ---------------------------------------------------------------------------


def ask_to_stop(keys: Keys) -> list[str]:
    """Return the statements with which a taker takes the stop key and rings the bells.

    A try: a stop key held exclusively (by no lockrun) must not block us. The commit
    sends the holders the NOTIFY while we wait; `rows.stop_taken` reads the first answer.
    """
    stop = (
        f"SELECT pg_try_advisory_lock_shared({keys.stop}::bigint), "
        f"pg_notify('{channel(keys)}', '')"  # rings the holders' bells
    )
    return [stop, "COMMIT"]


def unstop(server: Server, session: Session, keys: Keys) -> None:
    """Let a taker's stop key go: it gave up its wait, and a kept session asks nothing."""
    if session.stopping:
        session.rows(
            f"SELECT pg_advisory_unlock_shared({keys.stop}::bigint)", timeout=server.timeout
        )
        session.stopping = False


def give_up(
    server: Server, session: Session, attempt: Attempt[Session, Keys, Ahead], error: PgError | None
) -> None:
    """Let a taker's stop key go once its wait ran out at its deadline (`unstop`).

    A wait longer than lock_timeout can say runs out before the deadline, and is asked
    again: the stop key stays.
    """
    if error is None or error.sqlstate != LOCK_NOT_AVAILABLE:
        return
    if attempt.deadline is not None and now() >= attempt.deadline:
        unstop(server, session, attempt.key)


def listen(session: Session, keys: Keys) -> list[str]:
    """Return the statements that have a holder's session hear takers of *keys*' name."""
    if session.listening == channel(keys):
        return []
    return [*([UNLISTEN] if session.listening else []), f"LISTEN {channel(keys)}"]


def give_way(rows: Sequence[StopRow], lease: Lease, heard: AbstractSet[int] = frozenset()) -> None:
    """Raise `TakenOver` if *rows* of stop key holders name a taker but *lease*'s own."""
    who = taker(rows, lease.token, lease.names, heard)
    if who is not None:
        msg = f"taken over by {who}"
        raise TakenOver(msg)


def ring(lease: Lease) -> None:
    """Give *lease* its bell: its session's socket, turned readable by a taker's NOTIFY.

    A copy, as the supervisor watches the socket itself for a hang-up (docs/design.md A8).
    """
    lease.bells = (os.dup(lease.session.fileno()),)
