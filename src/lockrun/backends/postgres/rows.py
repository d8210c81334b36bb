"""Rows lockrun reads from PostgreSQL, decoded into named fields, and what each row means.

Every column of these rows is text that other clients can shape: a statement's comment
is anyone's to write, and so is a row of lockrun_holds. Each decoder owns the column
order of its statement; the classifiers are pure, for unit tests without a server.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final, NamedTuple, TypeAlias

from lockrun.backends import Holder, Identity, read_identity
from lockrun.bounds import MAX_SLOTS, MAX_WAIT

from .keys import tagged

if TYPE_CHECKING:
    from collections.abc import Sequence
    from collections.abc import Set as AbstractSet

    from .session import Row

_MAX_STAMP: Final = 2.0**40  # a Unix time past the year 36812 is made up (Holder's bound)
_OTHER_N: Final = "2"  # lockrun_others' kind of a holder of (name, N) with another N
_STOP_KEY: Final = "1"  # lockrun_others' kind of a holder of the name's stop key


# -- a grant's round trip (`grant.draw`) ---------------------------------------------------


class Drawn(NamedTuple):
    """The first row of a grant: whether the slot is ours, and the fence drawn."""

    got: bool
    fence: int | None

    @classmethod
    def read(cls, rows: Sequence[Row], *, shared: bool) -> Drawn:
        """Decode ``SELECT got, fence, …``: one row; a shared holder has no fence, nor NULL."""
        ((got, fence, *_),) = rows
        return cls(got == "t", None if shared or got != "t" or fence is None else int(fence))


class StopRow(NamedTuple):
    """A session holding a name's stop key, as pg_locks and its activity describe it."""

    pid: str | None
    query: str | None
    user: str | None
    client: str | None
    waiting: bool  # whether it waits for an advisory lock

    @classmethod
    def read(cls, row: Row) -> StopRow:
        """Decode (pid, query, user, client, waiting); missing columns are NULL."""
        pid, query, user, client, waiting = (*row, None, None, None, None, None)[:5]
        return cls(pid, query, user, client, waiting == "t")

    @property
    def number(self) -> int | None:
        """Return the server process id, if the row names one."""
        return int(self.pid) if self.pid and self.pid.isdecimal() else None


class OtherN(NamedTuple):
    """A live holder of the shared (name, N) lock with another N (`lockrun_others`)."""

    slots: int
    who: Identity | None  # its comment, read as untrusted


class Others(NamedTuple):
    """The rows of `lockrun_others`: users of another N, and the stop key's holders."""

    users: list[OtherN]
    stops: list[StopRow]

    @classmethod
    def read(cls, rows: Sequence[Row]) -> Others:
        """Decode (kind, objid, pid, query, user, client, waiting) rows by their kind."""
        users = [
            OtherN(int(row[1] or 0), tagged(row[3] or "")) for row in rows if row[0] == _OTHER_N
        ]
        stops = [StopRow.read(row[2:]) for row in rows if row[0] == _STOP_KEY]
        return cls(users, stops)


class Check(NamedTuple):
    """The rows of `lockrun_check`: whether our session holds its slot, and the takers."""

    holds: bool
    stops: list[StopRow]

    @classmethod
    def read(cls, rows: Sequence[Row]) -> Check:
        """Decode (ours, pid, query, user, client, waiting) rows."""
        ours = [row[0] == "t" for row in rows]
        return cls(any(ours), [StopRow.read(row[1:]) for row in rows if row[0] != "t"])


def stop_taken(rows: Sequence[Row]) -> bool:
    """Whether a taker's ``SELECT pg_try_advisory_lock_shared(stop), pg_notify(…)`` got it."""
    return list(rows[:1]) == [("t", "")]


def taker(
    rows: Sequence[StopRow], token: str, names: tuple[str, str], heard: AbstractSet[int]
) -> str | None:
    """Name the first taker in *rows* that is not the acquisition of *token*; None if none.

    A session that holds the stop key asks for a take-over, whoever it is, while it waits
    for a lock, or if it has just said so (a NOTIFY from its pid, in *heard*: its wait may
    not have begun when we looked). A stop key of a session that does neither is no
    request (a leftover). Its comment names the taker when it is a lockrun of the name
    *names* (namespace, name; read as untrusted), else its role and client do.
    """
    for row in rows:
        if row.waiting or row.number in heard:
            who = tagged(row.query or "")
            if who is None or who.token != token:  # else our own first session, at the gate
                return _described(row, who, names)
    return None


def _described(row: StopRow, who: Identity | None, names: tuple[str, str]) -> str:
    """Name a taker: as its comment says if it is a lockrun of *names*, else as the server does."""
    if who is not None and (who.namespace, who.name) == names:
        return f"{who.holder.user}@{who.holder.host} pid {who.holder.pid}"
    return f"{row.user or '?'}@{row.client or 'local socket'} (backend {row.pid})"


# -- --hold-at-least windows ---------------------------------------------------------------


class Window(NamedTuple):
    """A --hold-at-least window found on a slot just taken: seconds left, by the server."""

    remaining: float


def parse_window(rows: Sequence[Row]) -> Window | None:
    """Return the window in the rows of a read of it (``modes.WINDOW``), if one is open.

    Anyone may write the table: what is no number of seconds in (0, ∞) is no window,
    and a longer one is cut to `MAX_WAIT`.
    """
    if not rows or not rows[0]:
        return None
    try:
        remaining = float(rows[0][0] or "")
    except ValueError:
        return None
    if not 0 < remaining < math.inf:  # NaN too
        return None
    return Window(min(remaining, MAX_WAIT))


OpenWindow: TypeAlias = tuple[Identity | None, float]  # the run, as its row says; its end


def open_windows(rows: Sequence[Row]) -> dict[int, OpenWindow]:
    """Decode `status`'s rows of lockrun_holds (anyone's): key → (the run, if ours; its end)."""
    windows: dict[int, OpenWindow] = {}
    for row in rows:
        key, until, record = (*row, None, None, None)[:3]
        try:
            ends, slot = float(until or ""), int(key or "")
        except ValueError:
            continue
        if 0 < ends <= _MAX_STAMP:
            windows[slot] = (read_identity(record or ""), ends)
    return windows


def held_over(window: OpenWindow, namespace: str, name: str, table: str) -> Holder:
    """Describe the run whose --hold-at-least window is open, as its row says (untrusted).

    A row that is not one of ours for this name is shown as held by *table*.
    """
    who, until = window
    if who is None or (who.namespace, who.name) != (namespace, name):  # not a row of ours
        return Holder(table, 0, "?", (), slot=0, until=until)
    return who.holder._replace(slot=0, shared=False, expires=None, until=until)


# -- status: pg_locks beside pg_stat_activity ----------------------------------------------


def advisory_statement(waitstart: bool) -> str:
    """Return the statement whose rows `AdvisoryRow.read` decodes.

    Its parameters: the keys of the slots and the gate ($1, bigint[]), and the (name, N)
    lock's key ($2). *waitstart*: the server has pg_locks.waitstart (14+), which orders
    the waiters; else they come by pid.
    """
    waited = "extract(epoch FROM l.waitstart)" if waitstart else "NULL"
    return (
        "SELECT l.objsubid, (l.classid::bigint << 32) | l.objid::bigint, l.objid, "
        f"l.granted, l.pid, {waited}, a.usename, host(a.client_addr), "
        "extract(epoch FROM a.backend_start), a.query, l.mode, a.application_name, "
        "extract(epoch FROM a.state_change) "
        "FROM pg_locks l "
        "LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND ((l.objsubid = 1 "
        "AND (l.classid::bigint << 32) | l.objid::bigint = ANY($1::bigint[])) "
        "OR (l.objsubid = 2 AND l.classid = ($2::bigint & 4294967295)::oid)) "
        "ORDER BY 6, l.pid"
    )


class AdvisoryRow(NamedTuple):
    """One advisory lock of a name's, held or waited for, and the session's activity."""

    counter: bool  # objsubid 2: the shared (name, N) lock, whose objid is N
    key: int  # objsubid 1: the bigint key (a slot's or the gate's)
    objid: int
    granted: bool
    pid: str | None
    user: str | None
    client: str | None
    started: str | None  # the session's start, Unix time
    who: Identity | None  # the statement's comment, read as untrusted
    shared: bool  # held or wanted in ShareLock mode (--shared)
    label: str | None  # application_name
    changed: str | None = None  # when the session last began or ended a statement, Unix time

    @classmethod
    def read(cls, row: Row) -> AdvisoryRow:
        """Decode a row of `advisory_statement`, in its column order."""
        subid, key, objid, granted, pid, _, user, client, started, query, mode, label, changed = row
        return cls(
            counter=subid == "2",
            key=int(key or 0),
            objid=int(objid or 0),
            granted=granted == "t",
            pid=pid,
            user=user,
            client=client,
            started=started,
            who=tagged(query or ""),
            shared=mode == "ShareLock",
            label=label,
            changed=changed,
        )

    @property
    def token(self) -> str:
        """Return who the session is: its acquisition's token, else its server pid."""
        return self.who.token if self.who is not None else str(self.pid)

    @property
    def holder(self) -> Holder:
        """Describe the session, as its comment says, or as the server does (a stranger)."""
        person = self.who.holder if self.who is not None else self.stranger()
        return person._replace(shared=self.shared, until=None)

    def granted_to(self) -> Holder:
        """Describe the holder of a granted slot.

        A waiter's grant rides in its wait's message (`grant.wait_and_grant`), so until
        its next statement its comment is the waiter's, which names no slot: it was
        granted when that message ended (state_change), not when the wait began.
        """
        person = self.holder
        if self.who is not None and person.slot is None and self.changed:
            return person._replace(since=float(self.changed))
        return person

    def stranger(self) -> Holder:
        """Describe a session whose statements we may not read (another role's)."""
        where = self.client or "local socket"
        since = float(self.started) if self.started else None
        return Holder(f"{where} (backend {self.pid})", 0, self.user or "?", (), since=since)


class Holding(NamedTuple):
    """A session granted a slot."""

    holder: Holder


class Heading(NamedTuple):
    """A session at the head of the line: it holds the gate and waits for the slots.

    *first*: it holds slot 0 while it waits out a --hold-at-least window, first in line.
    """

    token: str
    holder: Holder
    first: bool = False


class Queued(NamedTuple):
    """A session in the line: it waits for the gate, or for slot 0 of a one-slot lock."""

    token: str
    holder: Holder


class Counted(NamedTuple):
    """A row that shows no one to list: only, perhaps, the N of a user of the name."""

    slots: int | None


def role(
    row: AdvisoryRow, slot: int | None, sitting: str | None
) -> Holding | Heading | Queued | Counted:
    """Say what *row* shows of its session; *slot* is the slot its key is, None the gate's.

    *sitting* is the application_name of a session of this name that waits out an open
    window on slot 0 (None: no window is open).
    """
    if row.counter:  # any role may take such a lock: only an N a lockrun could use counts
        return Counted(row.objid if 1 <= row.objid <= MAX_SLOTS else None)
    if row.granted:
        return _granted(row, slot, sitting)
    if slot is None or row.who is None or row.who.slots == 1:
        return Queued(row.token, row.holder)
    return Heading(row.token, row.holder)


def _granted(
    row: AdvisoryRow, slot: int | None, sitting: str | None
) -> Holding | Heading | Counted:
    """Say what a granted *row* shows (`role`)."""
    if slot == 0 and sitting is not None and row.label == sitting:
        return Heading(row.token, row.holder, first=True)  # waits out the window, first in line
    if slot is not None:
        return Holding(row.granted_to()._replace(slot=slot))
    return Counted(None)  # the gate's holder: it shows in its wait for a slot
