"""lockrun_holders and lockrun_fence: the check of N, and the grant's round trip.

The grant is one round trip (docs/design.md A7): the holder's record and the fence, each
written only by the session that holds the slot, then the check for users of another N,
which sees every record written before ours, and the reads of a take-over's stop lock and
of lockrun_marks. A one-slot lock's first try carries the grant in its own round trip
(`try_drawing`). Each statement is named where it is added (`lockrun.backends.mysql.batch`),
so the server sees them in this order and each answer is read by its name.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import pymysql
from pymysql.constants import ER

from lockrun.backends.mysql.batch import Answer, Batch, Reply, first_row, last_id, rows, value
from lockrun.backends.mysql.modes import HOLD_OPTION, Found, found_marks, mismatch
from lockrun.backends.mysql.session import (
    NO_TABLES,
    STATEMENT_ERRORS,
    make_tables,
    said,
    sweep,
    tableless,
)
from lockrun.backends.mysql.statements import (
    FENCES,
    GRANT_READS,
    GRANT_READS_N,
    HOLDERS,
    MARKS_OF,
    MISMATCH,
    NEXT_FENCE,
    RECORD,
    RECORD_LATER,
    RECORD_ROOM,
    SHARED_MISMATCH,
    SINCE_LATER,
    STOP,
    get_lock,
    other_row,
)
from lockrun.backends.sessionlock import GATE
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import Request
    from lockrun.backends.mysql.modes import Mode, Modes
    from lockrun.backends.mysql.session import Server, Session
    from lockrun.backends.sessionlock import Attempt


class Drawn(NamedTuple):
    """What the grant's round trip drew and read."""

    fence: int | None  # None where the tables are out of reach
    other: tuple[Any, ...] | None  # a live user of another N: its (slots, holder) row
    found: Found | None  # what the modes' marks say; None: marks to read (`Modes.look`)
    record: str  # the holder's JSON, as recorded
    stale: bool = False  # drawn so long ago that the slot must be proved ours again


class Check(NamedTuple):
    """The check of N with a try: the batch, and the names of its statements."""

    batch: Batch
    other: Reply[tuple[Any, ...] | None]  # a live holder of another N
    tried: Reply[Any]  # the try's answer
    shared: Reply[tuple[Any, ...] | None] | None  # a live shared holder, for a user of N > 1

    def found(self) -> tuple[Any, ...] | None:
        """Return the (slots, holder) row of a live user of another N, if the check found one."""
        return self.other.value or (None if self.shared is None else self.shared.value)


class Grant(NamedTuple):
    """The grant's batch, and the names of the statements whose answers count."""

    batch: Batch
    fence: Reply[int]
    stop: Reply[Any]  # the session holding KEY:stop, if any
    other: Reply[tuple[Any, ...] | None]  # a live user of another N
    # N > 1: a live shared holder's row; N = 1: whether marks may count (`GRANT_READS`),
    # or their rows (`MARKS_OF`, where the reads go one by one: `apart`)
    last: Reply[Any]
    apart: bool = False


def check_batch(key: str, slots: int, statement: str) -> Check:
    """Return the check for a live holder of another N, with *statement* after it."""
    batch = Batch()
    other = batch.add(MISMATCH, (key, slots), read=first_row)
    tried = batch.add(statement, read=value)
    shared = batch.add(SHARED_MISMATCH, (key, key), read=first_row) if slots > 1 else None
    return Check(batch, other, tried, shared)


def checked(
    session: Session,
    attempt: Attempt[Session, str, Mode],
    statement: str,
    caught: Callable[[Any], str | None],
) -> Any:  # noqa: ANN401 - the try's answer
    """Check for a live holder of another N, then run *statement*, a try that never waits.

    One round trip; return the try's answer. A holder of another N is refused (78), once
    the lock the try caught, if any (*caught* names it from the answer), is let go.
    Without the tables nobody recorded anything: the try runs alone. A user of N > 1
    also looks for shared holders, who use one slot, where their table is (it may be
    missing).
    """
    check = check_batch(attempt.key, attempt.slots, statement)
    try:
        session.run(check.batch)
    except STATEMENT_ERRORS as err:
        if not tableless(err) or check.tried.failed:
            raise
        if not check.other.answered:
            return session.one(statement)  # the grant finds out about the tables and says so
    found = check.found()
    if found is not None:
        lock = caught(check.tried.value)
        if lock is not None:
            session.one("SELECT RELEASE_LOCK(%s)", (lock,))
        raise mismatch(attempt.request, found)
    return check.tried.value


def grant_batch(
    key: str,
    request: Request,
    slot: int,
    record: str,
    *,
    gate: bool,
    batch: Batch | None = None,
    later: bool = False,
) -> Grant:
    """Return the grant's statements for *slot* of *key*, in the order the server runs them.

    The fence and the record in one transaction (one commit where an earlier lockrun made
    the tables in InnoDB; nothing to flush in MEMORY), each written only if this session
    holds the slot; the gate's release (*gate*: this session holds it); then the reads in
    one statement (`GRANT_READS`), which may find a table out of reach. Added to *batch*,
    if given: after the try that takes the slot.
    """
    batch = Batch() if batch is None else batch
    lock = f"{key}:{slot}"
    batch.add("START TRANSACTION")
    # The fence first: a user who may not draw one (no fence, `draw`) leaves no record in
    # MEMORY, where no rollback takes it back.
    fence = batch.add(NEXT_FENCE, (key, lock), read=last_id)
    written = RECORD_LATER if later else RECORD  # *later*: the server's "since" (`holder_record`)
    batch.add(written, (key, slot, request.slots, request.namespace, request.name, record, lock))
    batch.add("COMMIT")
    if gate:
        batch.add("SELECT RELEASE_LOCK(%s)", (f"{key}:{GATE}",))
    reads = GRANT_READS if request.slots == 1 else GRANT_READS_N
    args = (f"{key}:{STOP}", key, request.slots, key) + ((key,) if request.slots > 1 else ())
    read = batch.add(reads, args, read=first_row)
    return Grant(
        batch,
        fence,
        Reply(batch, read.index, lambda answer: _column(answer, 0)),
        Reply(batch, read.index, lambda answer: other_row(_column(answer, 1))),
        Reply(batch, read.index, lambda answer: _column(answer, 2)),
    )


def apart_reads(key: str, request: Request) -> Grant:
    """Return the grant's reads one statement each, for a server where `GRANT_READS` failed.

    Its tables are not all within reach (lockrun_marks, say): the reads that are still
    answer, in order, up to the first that is not.
    """
    batch = Batch()
    stop = batch.add("SELECT IS_USED_LOCK(%s)", (f"{key}:{STOP}",), read=value)
    other = batch.add(MISMATCH, (key, request.slots), read=first_row)
    if request.slots > 1:
        last: Reply[Any] = batch.add(SHARED_MISMATCH, (key, key), read=first_row)
    else:
        last = batch.add(MARKS_OF, (key, key), read=rows)
    return Grant(batch, Reply(batch, 0, _nothing), stop, other, last, apart=True)


def _column(answer: Answer, index: int) -> Any:  # noqa: ANN401 - a column's value
    return answer.rows[0][index] if answer.rows else None


def _nothing(_answer: Answer) -> int:
    return 0


def read_grant(grant: Grant, slots: int, record: str, fence: int | None = None) -> Drawn:
    """Decode the answers to *grant*, a grant of a lock of *slots* slots.

    *fence* is the one drawn, where *grant* holds only the reads (`apart_reads`).
    """
    stop = grant.stop.value
    fence = grant.fence.value if fence is None else fence
    if slots > 1:
        last = grant.last.value
        shared = other_row(last) if not grant.apart else last
        return Drawn(fence, grant.other.value or shared, Found(stop), record)
    if grant.apart:
        found: Found | None = found_marks(grant.last.value, stop)
    else:  # marks that may count are read in a round trip of their own (`Modes.look`)
        found = None if grant.last.value else Found(stop)
    return Drawn(fence, grant.other.value, found, record)


def holder_record(request: Request, slot: int, *, later: bool = False) -> str:
    """Return the record of *request*'s holder of *slot*: ASCII JSON that fits lockrun_holders.

    *later*: "since" is left for the server to fill in (`RECORD_LATER`), with room for it.
    """
    holder = request.holder._replace(slot=slot, since=0.0 if later else time.time())
    record = json.dumps(holder.to_dict())
    if len(record) > RECORD_ROOM - (16 if later else 0):  # names of hundreds of characters:
        record = json.dumps(  # said without argv
            holder._replace(host=holder.host[:64], user=holder.user[:64], argv=()).to_dict()
        )
    return record


class Tried(NamedTuple):
    """A try of slot 0 that carried its grant (`try_drawing`)."""

    got: Any  # GET_LOCK's answer: 1, 0 (busy or the wait ran out), None (cancelled)
    drawn: Drawn | None  # the grant, if the try took the slot and it could be read whole
    # Where the try found the lock busy: whether the grant's reads answered, so that they
    # served as the check of N (`Statements.refuse_mismatch`), and the user of another N
    # they found, if any.
    checked: bool = False
    other: tuple[Any, ...] | None = None


def try_drawing(
    server: Server,
    session: Session,
    attempt: Attempt[Session, str, Mode],
    seconds: float = 0,
    timeout: float | None = 0,
) -> Tried:
    """Try slot 0, waiting up to *seconds*, and draw its grant in the same round trip.

    The grant's writes happen only if the try took the slot. Drawn is None where the
    grant could not be read whole (the tables are missing or out of reach, the marks a
    hold needs): then the grant takes a round trip of its own (`draw`), which says why.
    A try that waits carries the waiter's tag (for `status`) and is given *timeout* to
    answer (None: as long as it takes). A try that found the lock busy still read who
    uses it with another N: the check of N, for nothing more.
    """
    request = attempt.request
    record = holder_record(request, 0, later=bool(seconds))
    batch = Batch()
    tag = attempt.tag if seconds else ""
    tried = batch.add(get_lock(f"{attempt.key}:0", seconds, tag), read=value)
    grant = grant_batch(
        attempt.key, request, 0, record, gate=False, batch=batch, later=bool(seconds)
    )
    sent = now()
    try:
        _run_grant(session, batch, optional=grant.other.index, timeout=timeout)
    except pymysql.err.Error:
        if not tried.answered:
            raise
        return Tried(tried.value, None)
    if tried.value != 1:
        checked = grant.other.answered
        return Tried(tried.value, None, checked, grant.other.value if checked else None)
    if not grant.other.answered:  # a table out of reach: `draw` reads apart, and says why
        return Tried(tried.value, None)
    server.tables = True
    # The grant's time: the lease runs from the try, which the grant followed on the
    # server. A wait of a third of a lease or more (a long queue, a process stopped while
    # the grant ran) proves the slot ours again first (`Drawn.stale`): the server's idle
    # clock may have run since the grant, while nobody here could tell.
    attempt.sent = sent
    if seconds:  # as the server wrote it, near enough
        record = record.replace(SINCE_LATER, f'"since": {time.time()}')
    drawn = read_grant(grant, 1, record)
    return Tried(tried.value, drawn._replace(stale=now() - sent >= server.ttl / 3))


def draw(
    server: Server, modes: Modes, session: Session, attempt: Attempt[Session, str, Mode], slot: int
) -> Drawn:
    """Record the holder, draw a fence, check for another N, look at the modes' marks.

    The holder of the gate lets it go in the same round trip, after the commit
    (`MySQLBackend._release_gate`). The fence is None where the tables are out of reach;
    the record and the check are left out too, and the marks are read (in a round trip of
    their own) only by an attempt that waited or has a mode.
    """
    request = attempt.request
    record = holder_record(request, slot)
    if server.tables is False:
        plain = attempt.state is None and not attempt.queued and not request.hold
        return Drawn(None, None, Found() if plain else modes.look(session, attempt), record)
    gate = attempt.gate is session
    grant = grant_batch(attempt.key, request, slot, record, gate=gate)
    try:
        _run_making_tables(session, grant.batch, optional=grant.other.index)
    except STATEMENT_ERRORS as err:
        _tables_out_of_reach(server, err)
        return Drawn(None, None, modes.look(session, attempt), record)
    server.tables = True
    if gate:
        session.gate_left = attempt
    if grant.other.answered:
        return read_grant(grant, request.slots, record)
    # A table the reads need is out of reach (lockrun_marks, say): the reads one by one.
    apart = apart_reads(attempt.key, request)
    _run_grant(session, apart.batch, optional=apart.other.index)
    if request.hold and not apart.last.answered:  # the marks could not be read:
        raise modes.no_marks(HOLD_OPTION)  # no window could be kept: said before the run
    return read_grant(apart, request.slots, record, grant.fence.value)


def _tables_out_of_reach(server: Server, err: pymysql.err.Error) -> None:
    """Note, once, that lockrun's tables cannot be used: no fence; re-raise any other *err*."""
    if err.args[0] not in NO_TABLES:
        raise err
    server.tables = False
    server.note(
        f"no fence: cannot use the tables {FENCES} and {HOLDERS} on "
        f"{server.where} ({said(server.settings, err)}); LOCKRUN_FENCE stays unset"
    )


def _run_making_tables(session: Session, batch: Batch, optional: int) -> None:
    """Run the grant's *batch*; on first use, make the tables and run it again.

    A table in memory that is full (max_heap_table_size) is swept of rows that no longer
    count, and the batch runs again.
    """
    try:
        _run_grant(session, batch, optional)
    except pymysql.err.Error as err:
        code = err.args[0] if err.args else None
        if code == ER.NO_SUCH_TABLE:
            make_tables(session)
        elif code == ER.RECORD_FILE_FULL:
            sweep(session)
        else:
            raise
    else:
        return
    _run_grant(session, batch, optional)


def _run_grant(session: Session, batch: Batch, optional: int, timeout: float | None = 0) -> None:
    """Run the grant's *batch* in one round trip.

    The statements from *optional* on (reads of the records and marks) may find their
    table out of reach: as without the tables, there is nothing to find, and the batch
    ends there. Any other error is raised after a rollback, so that the session, which may
    serve more acquisitions, is never left in a transaction.
    """
    try:
        session.run(batch, timeout=timeout)
    except pymysql.err.Error as err:
        if len(batch.answers) >= optional and tableless(err):
            return
        with contextlib.suppress(pymysql.err.Error):  # best effort: the session may be gone
            session.one("ROLLBACK")
        raise
