"""`lockrun status` on MySQL and MariaDB: who holds which slot, who waits.

Decode first, decide second: each server row is decoded by one function that owns its
statement's order of columns (`holder_row`, `waiter`, `lockrun.backends.mysql.modes.mark_row`),
and small pure functions decide what the decoded rows make of a lock (`counted`, `seats`,
`mark_holder`, `line_up`). Anyone who may write lockrun's tables may forge a row, and any
session may wait with a comment of its own: neither is believed beyond what it can prove.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

import pymysql

from lockrun.backends import Holder, LockState, read_identity, read_json
from lockrun.backends.mysql.modes import MarkRow, mark_kind, mark_row
from lockrun.backends.mysql.session import STATEMENT_ERRORS
from lockrun.backends.mysql.statements import (
    HOLDERS_OF,
    MARKS_OF,
    RECORDED,
    WAITING,
    lock_key,
)
from lockrun.bounds import MAX_SLOTS

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from lockrun.backends.mysql.session import Server, Session

_PROBED_SLOTS: Final = 64  # `status` looks at this many slots when it cannot learn N


class Waiter(NamedTuple):
    """A lockrun waiter as its GET_LOCK's comment describes it in the processlist."""

    connection: int
    lock: str
    token: str
    namespace: str
    name: str
    slots: int
    holder: Holder


class HolderRow(NamedTuple):
    """A row of lockrun_holders: who recorded itself as the holder of a slot."""

    slot: int
    slots: int
    connection: int
    record: str  # the holder's JSON, as written


class Seat(NamedTuple):
    """A slot a session holds, and who holds it if our record says so."""

    slot: int
    connection: int
    holder: Holder | None  # None: the record is not that session's; ask the processlist


def read_states(server: Server, namespace: str, name: str | None) -> list[LockState]:
    """Report holders and waiters of *name*, or of every lock in *namespace*."""
    session = server.session()
    try:
        queue = waiters(session)
        if name is not None:
            return [_state(session, namespace, name, queue)]
        names = set(_recorded(session, namespace))
        names |= {waiter.name for waiter in queue if waiter.namespace == namespace}
        states = [_state(session, namespace, each, queue) for each in sorted(names)]
        return [state for state in states if state.holders or state.waiters]
    except pymysql.err.Error as err:
        raise server.failure(err) from err
    finally:
        session.close()


def _recorded(session: Session, namespace: str) -> list[str]:
    """Return the names lockrun's tables have holders or windows of (none without them)."""
    names: list[str] = []
    for statement in RECORDED:
        with contextlib.suppress(*STATEMENT_ERRORS):
            names += [str(row[0]) for row in session.rows(statement, (namespace,))]
    return names


def _state(session: Session, namespace: str, name: str, everyone: list[Waiter]) -> LockState:
    """Read one lock: who holds which slot (IS_USED_LOCK, our records), who waits."""
    key = lock_key(namespace, name)
    queue = [waiter for waiter in everyone if waiter.lock.startswith(f"{key}:")]
    records: dict[int, HolderRow] = {}
    with contextlib.suppress(*STATEMENT_ERRORS):
        decoded = (holder_row(row) for row in session.rows(HOLDERS_OF, (key,)))
        records = {row.slot: row for row in decoded if row is not None}
    marked = _marked(session, key)
    known = counted(records.values(), queue, marked=bool(marked))
    probed = max(known, default=_PROBED_SLOTS)
    used = session.row(
        "SELECT " + ", ".join(f"IS_USED_LOCK('{key}:{slot}')" for slot in range(probed))
    )
    holders = [seat.holder or _seen(session, seat) for seat in seats(used, records, queue)]
    return LockState(
        namespace, name, key, max(known, default=None), (*holders, *marked), line_up(queue)
    )


def _marked(session: Session, key: str) -> list[Holder]:
    """Return the holders that rows of lockrun_marks add: a window's run, shared holders."""
    try:
        found = session.rows(MARKS_OF, (key, key))
    except STATEMENT_ERRORS:
        return []
    decoded = (mark_row(row) for row in found)
    holders = (mark_holder(row) for row in decoded if row is not None)
    return [holder for holder in holders if holder is not None]


def _seen(session: Session, seat: Seat) -> Holder:
    """Describe the session of *seat* as the processlist shows it: no record of ours."""
    row = session.row(
        "SELECT USER, HOST FROM information_schema.PROCESSLIST WHERE ID = %s", (seat.connection,)
    )
    user, host = ("?", "?") if row is None else (str(row[0]), str(row[1]))
    return Holder(f"{host} (connection {seat.connection})", 0, user, (), slot=seat.slot)


def waiters(session: Session) -> list[Waiter]:
    """Return every lockrun waiter the processlist shows, longest waiting first."""
    waited = "TIME_MS" if session.mariadb else "TIME"  # MySQL knows whole seconds only
    rows = session.rows(
        f"SELECT ID, {waited}, INFO FROM information_schema.PROCESSLIST "
        "WHERE ID <> CONNECTION_ID() AND (INFO LIKE 'SELECT GET\\_LOCK(''lr:%' "
        "OR INFO LIKE 'SELECT SLEEP(%')"
    )
    ordered = sorted(rows, key=lambda row: (-float(row[1] or 0), int(row[0])))
    return [each for each in map(waiter, ordered) if each is not None]


# -- decoding rows ----------------------------------------------------------------------------


def waiter(row: Sequence[Any]) -> Waiter | None:
    """Decode a processlist row (ID, time, INFO): a waiter of ours, or None.

    None too for a comment that is not ours after all, or forged badly.
    """
    connection, _, info = row
    match = WAITING.fullmatch(str(info))
    who = None if match is None else read_identity(match["json"])  # "*\\/" is JSON's "*/"
    if match is None or who is None:
        return None
    return Waiter(int(connection), f"{match['key']}:{match['part']}", *who)


def holder_row(row: Sequence[Any]) -> HolderRow | None:
    """Decode a row of `HOLDERS_OF`, which owns the order of its columns; None if it is none."""
    try:
        slot, slots, connection, record = row
        return HolderRow(int(slot), int(slots), int(connection), str(record))
    except (TypeError, ValueError, OverflowError):  # a table altered by another: not ours
        return None


def recorded_holder(record: object, connection: object) -> Holder:
    """Return the holder a mark's record names; a record that is none names the session."""
    try:
        return Holder.from_dict(read_json(record if isinstance(record, str) else ""))
    except ValueError:  # anyone who may write the table may forge
        return Holder(f"? (connection {connection})", 0, "?", ())


# -- deciding -----------------------------------------------------------------------------------


def counted(records: Iterable[HolderRow], queue: Iterable[Waiter], *, marked: bool) -> set[int]:
    """Return the numbers of slots the lock's users say it has: N, as lockrun could write it.

    A window or shared holders (*marked*) are users of a lock of one slot.
    """
    known = {row.slots for row in records} | {waiter.slots for waiter in queue}
    known = {slots for slots in known if 1 <= slots <= MAX_SLOTS}  # the table is anyone's
    return known | {1} if marked else known


def seats(
    used: Sequence[Any], records: Mapping[int, HolderRow], queue: Iterable[Waiter]
) -> list[Seat]:
    """Return the slots held, from IS_USED_LOCK of each (*used*), and who holds them.

    A session that holds slot 0 while it waits (for shared holders to leave, or a window
    to end) is a waiter, not a holder: it is in the queue's statements. Our record of a
    slot names its holder only if it is the record of the session that holds it.
    """
    waiting = {waiter.connection for waiter in queue}
    found = []
    for slot, connection in enumerate(used):
        if connection is None or int(connection) in waiting:
            continue
        record = records.get(slot)
        holder = None
        if record is not None and record.connection == int(connection):
            with contextlib.suppress(ValueError):  # anyone who may write the table may forge
                holder = Holder.from_dict(read_json(record.record))._replace(slot=slot)
        found.append(Seat(slot, int(connection), holder))
    return found


def mark_holder(row: MarkRow) -> Holder | None:
    """Return the holder a row of lockrun_marks adds, if it counts: a window's, a reader's.

    A window is cut to the longest a hold can be (`mark_row`); a record that is none is
    shown as its session.
    """
    kind = mark_kind(row)
    if kind == "reader":
        holder = recorded_holder(row.record, row.connection)
        return holder._replace(slot=0, shared=True, until=None)
    if kind != "window" or not row.window or not isinstance(row.server_now, int):
        return None
    until = row.server_now / 1_000_000 + row.window
    return recorded_holder(row.record, row.connection)._replace(slot=0, until=until)


def role(waiter: Waiter) -> Literal["head", "queued"]:
    """Say where *waiter* is: at the head (on the slots, one line per slot) or on the gate."""
    return "queued" if waiter.lock.endswith(":gate") else "head"


def line_up(queue: Iterable[Waiter]) -> tuple[Holder, ...]:
    """Return the people of *queue*, the head first, each once (in the processlist's order)."""
    ordered = sorted(queue, key=lambda waiter: role(waiter) == "queued")
    people = {waiter.token: waiter.holder for waiter in ordered}  # dicts keep the order
    return tuple(people.values())
