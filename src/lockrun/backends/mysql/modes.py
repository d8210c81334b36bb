"""--shared, --take-over and --hold-at-least on MySQL and MariaDB (docs/design.md A7).

The modes add ``KEY:r:TOKEN`` for each shared holder, ``KEY:stop`` for a take-over request,
and rows in lockrun_marks: hold windows on the server's clock, shared holders, who takes
over. Anyone who may write that table may forge a row: `mark_row` decodes each into a
`MarkRow`, and `mark_kind` says what it counts as, before anything is decided on it.
"""

from __future__ import annotations

import contextlib
import decimal
import json
import time
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

import pymysql
from pymysql.constants import ER

from lockrun.backends import Holder, read_identity, read_json, slots_mismatch
from lockrun.backends.mysql.batch import Batch, first_row, rows, value
from lockrun.backends.mysql.session import (
    CANCELLED,
    STATEMENT_ERRORS,
    make_tables,
    said,
    tableless,
)
from lockrun.backends.mysql.statements import (
    END_WINDOW,
    HOLD,
    MARK,
    MARKS,
    MARKS_OF,
    MAX_HOLD_US,
    MISMATCH,
    READER,
    STOP,
    STOP_MARK,
    SWEEP,
    TAKER,
    UNMARK,
    WAITING,
)
from lockrun.errors import BackendUnavailable, ConfigError, TakenOver
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from lockrun.backends import Request
    from lockrun.backends.mysql.batch import Reply
    from lockrun.backends.mysql.session import Server, Session
    from lockrun.backends.sessionlock import Attempt

HOLD_OPTION: Final = "--hold-at-least"
# A taker writes its row a moment after it got the stop lock: who it is is asked this often.
_WHO_TRIES: Final = 3
_WHO_PAUSE: Final = 0.05


class Mode:
    """What a shared or take-over attempt registered and found (`Attempt.state`)."""

    def __init__(self) -> None:
        """Start with nothing registered."""
        self.stop: Session | None = None  # a taker's session holding KEY:stop
        self.tried = False  # whether a shared request tried to enter (with its check of N)
        self.entered = False  # whether that try entered: the lease needs no statement


class Found(NamedTuple):
    """What a grant read of the modes: a take-over, a window, shared holders."""

    stop: object = None  # the session holding KEY:stop, if any
    window: float = 0.0  # seconds of a hold window left
    readers: tuple[str, ...] = ()  # the marks of live shared holders
    swept: bool = False  # whether rows of shared holders that ended are left to sweep


class MarkRow(NamedTuple):
    """A row of `MARKS_OF`, decoded: whatever a co-tenant wrote, typed and bounded."""

    mark: str  # "" for one that is not text
    connection: object  # the session that wrote it, as the row says: shown, never trusted
    window: float  # seconds left of a window, in [0, a year]
    live: bool  # whether a reader's session holds its lock
    record: object  # the holder's JSON, as written
    server_now: object  # the server's Unix time in µs when it read the row


MarkKind = Literal["window", "reader", "ended", "other"]


def mark_row(row: object) -> MarkRow | None:
    """Decode a row of `MARKS_OF`, which owns the order of the columns; None if it is none."""
    if not isinstance(row, tuple) or len(row) < 4:  # noqa: PLR2004 - the columns decided on
        return None
    mark, connection, left, live, *rest = row
    record, server_now = (*rest, None, None)[:2]
    text = mark if isinstance(mark, str) else ""
    return MarkRow(text, connection, micros(left), bool(live == 1), record, server_now)


def mark_kind(row: MarkRow) -> MarkKind:
    """Say what *row* counts as: a window, a live reader of ours, a reader that ended, nothing."""
    if row.mark == HOLD:
        return "window"
    if not row.mark.startswith("r:"):
        return "other"
    return "reader" if row.live and READER.fullmatch(row.mark) else "ended"


def found_marks(rows: Sequence[object], stop: object = None) -> Found:
    """Read `MARKS_OF`'s rows, which anyone who may write the table could have forged."""
    window, readers, swept = 0.0, [], False
    for row in filter(None, map(mark_row, rows)):
        kind = mark_kind(row)
        if kind == "window":
            window = max(window, row.window)
        elif kind == "reader":
            readers.append(row.mark)
        elif kind == "ended":
            swept = True
    return Found(stop, window, tuple(readers), swept)


def micros(value: object) -> float:
    """Return µs read back as seconds, 0 unless a number in [0, `MAX_HOLD_US`]."""
    if isinstance(value, bool) or not isinstance(value, int | float | decimal.Decimal):
        return 0.0
    seconds = float(value) / 1_000_000
    return seconds if 0 <= seconds <= MAX_HOLD_US / 1_000_000 else 0.0


def reading(attempt: Attempt[Session, str, Mode]) -> bool:
    """Whether *attempt* enters as a shared holder beside others (a shared taker does not)."""
    return attempt.request.shared and (attempt.state is None or attempt.state.stop is None)


def _registered(attempt: Attempt[Session, str, Mode]) -> Mode:
    """Return what `Modes.begin` registered for *attempt*, a shared or take-over one."""
    mode = attempt.state
    assert mode is not None  # noqa: S101 - begin gives every shared request its Mode
    return mode


def reusable(session: Session, attempt: Attempt[Session, str, Mode]) -> bool:
    """Whether *session* holds nothing: not a taker's stop request."""
    return attempt.state is None or attempt.state.stop is not session


def mismatch(request: Request, row: tuple[Any, ...]) -> ConfigError:
    """Return the error for a live user of another N, from its (slots, holder) row."""
    slots, record = row
    try:
        holder = Holder.from_dict(read_json(str(record)))
    except ValueError:  # a row another client of the server wrote: said without it
        holder = None
    return slots_mismatch(request, int(slots), holder)


class Modes:
    """The modes' statements on a server's sessions, for `MySQLBackend`'s hooks."""

    def __init__(self, server: Server) -> None:
        """Work on *server*'s sessions."""
        self.server = server

    # -- before the first try -------------------------------------------------------------

    def begin(self, session: Session, attempt: Attempt[Session, str, Mode]) -> bool:
        """Give a shared or take-over request its state; a taker asks for the stop first.

        The stop request is the GET_LOCK KEY:stop, held by the taker's first session while
        it waits, and a row naming the taker. Takers queue on it: the newest that got it
        makes an older one that is granted meanwhile give way (`end_stop`).
        """
        request = attempt.request
        if not (request.shared or request.take_over):
            return True
        attempt.state = mode = Mode()
        if not request.take_over:
            return True
        if request.shared:  # a shared taker that can join the readers stops nobody
            mode.tried = True
            if self.join(session, attempt):
                mode.entered = True
                return True
        if not self._ask_stop(session, attempt):
            return False
        mode.stop = session
        return True

    def _ask_stop(self, session: Session, attempt: Attempt[Session, str, Mode]) -> bool:
        """Take KEY:stop and write the row naming the taker, or wait in KEY:stop's queue."""
        request, key = attempt.request, attempt.key
        stop = f"{key}:{STOP}"
        record = json.dumps(request.holder.to_dict())
        row = (key, request.namespace, request.name, record, stop)
        batch = Batch()
        got = batch.add("SELECT GET_LOCK(%s, 0)", (stop,), read=value)
        batch.add(STOP_MARK, row)
        try:
            session.run(batch)
        except STATEMENT_ERRORS as err:
            if not got.answered or not tableless(err):  # no row: the message says less
                raise
        if got.value is None:
            raise self.server.cancelled(STOP)
        if got.value == 1:
            return True
        if not self.server.wait_for(session, stop, attempt, STOP):
            return False
        with contextlib.suppress(*STATEMENT_ERRORS):
            session.one(STOP_MARK, row)  # best effort, as above
        return True

    # -- shared holders -------------------------------------------------------------------

    def enter_shared(
        self, session: Session, seconds: float | None, attempt: Attempt[Session, str, Mode]
    ) -> bool:
        """Enter as a shared holder at once if no one holds or waits for the lock.

        Else queue in slot 0's queue as an exclusive request does; the grant then passes
        through slot 0 (`grant_shared`). Consecutive shared requests at the head of the
        queue so all enter, and a later one never overtakes a queued exclusive one.
        """
        mode = _registered(attempt)
        if not mode.tried:
            mode.tried = True
            if self.join(session, attempt):
                mode.entered = True
                return True
        if seconds == 0:
            return False
        return self.server.get(session, f"{attempt.key}:0", seconds, attempt, 0)

    def join(self, session: Session, attempt: Attempt[Session, str, Mode]) -> bool:
        """Take this shared holder's lock and row; True if they count, else leave none.

        The row counts only if, once it is written, nobody holds slot 0, asks for a
        take-over, or keeps a window: an exclusive holder reads the rows after it got slot
        0, so one of the two always sees the other (docs/design.md A7). One round trip,
        with the check for users of another N.
        """
        key = attempt.key
        batch, got = _reader_batch(attempt)
        used = batch.add(
            "SELECT IS_USED_LOCK(%s), IS_USED_LOCK(%s)",
            (f"{key}:0", f"{key}:{STOP}"),
            read=first_row,
        )
        marks = batch.add(MARKS_OF, (key, key), read=rows)
        other = batch.add(MISMATCH, (key, 1), read=first_row)
        sent = now()
        if not self._mark(session, attempt, batch, got):
            return False
        mark = f"r:{attempt.token}"
        if other.value is not None:
            unmark(session, key, mark)
            raise mismatch(attempt.request, other.value)
        slot0, stop = used.value or (None, None)
        if slot0 is None and stop is None and not found_marks(marks.value).window:
            attempt.sent = sent
            return True
        unmark(session, key, mark)
        return False

    def grant_shared(self, session: Session, attempt: Attempt[Session, str, Mode]) -> bool:
        """Hold the lock shared: entered by the try, or now through slot 0, which it holds.

        False if what the grant found made the lock busy: slot 0 is given back.
        """
        mode = _registered(attempt)
        if mode.entered:
            return True
        slot0 = f"{attempt.key}:0"
        if not self.settle(session, attempt, slot0, self.look(session, attempt)):
            session.one("SELECT RELEASE_LOCK(%s)", (slot0,))
            return False
        attempt.proved = now()
        # Holding slot 0: take our lock and row, and let slot 0 go, in one round trip.
        batch, got = _reader_batch(attempt)
        batch.add("SELECT RELEASE_LOCK(%s)", (f"{attempt.key}:0",))
        if not self._mark(session, attempt, batch, got):
            lock = f"{attempt.key}:r:{attempt.token}"
            msg = f"{self.server.where}: the lock {lock} is held by another session"
            raise BackendUnavailable(msg)
        return True

    def _mark(
        self, session: Session, attempt: Attempt[Session, str, Mode], batch: Batch, got: Reply[Any]
    ) -> bool:
        """Run a shared holder's *batch*; False, leaving no row, if its lock is not ours.

        Another session holding our random name: it is not ours.
        """
        mark = f"r:{attempt.token}"
        try:
            self.need_marks(session, batch, "--shared")
        except BaseException:
            unmark(session, attempt.key, mark)
            raise
        if got.value != 1:
            unmark(session, attempt.key, mark)
            return False
        return True

    def need_marks(self, session: Session, batch: Batch, mode: str) -> None:
        """Run *batch*, which needs lockrun's tables, making them on first use.

        A user who may not use them gets `ConfigError`: *mode* cannot work without them.
        Nothing before the failing statement has changed anything then: a mark is written
        first.
        """
        with self._marks_needed(mode):
            try:
                session.run(batch)
            except STATEMENT_ERRORS as err:
                if not err.args or err.args[0] != ER.NO_SUCH_TABLE:
                    raise
            else:
                return
            make_tables(session)
            session.run(batch)

    @contextlib.contextmanager
    def _marks_needed(self, mode: str) -> Iterator[None]:
        """Turn an error that says the tables are out of reach into `no_marks`' for *mode*."""
        try:
            yield
        except STATEMENT_ERRORS as err:
            if not tableless(err):
                raise
            raise self.no_marks(mode, err) from err

    def no_marks(self, mode: str, err: pymysql.err.Error | None = None) -> ConfigError:
        """Return the error for *mode* without lockrun_marks (*err*: what the server said)."""
        said_ = "" if err is None else f" ({said(self.server.settings, err)})"
        return ConfigError(
            f"{self.server.where}: {mode} needs lockrun's table {MARKS}, which this user cannot "
            f"create or use{said_}; create the tables ahead "
            "(docs/backends.md) or grant SELECT, INSERT, UPDATE, DELETE on them"
        )

    # -- after the slot is ours -----------------------------------------------------------

    def look(self, session: Session, attempt: Attempt[Session, str, Mode]) -> Found:
        """Read, after the slot is ours: a take-over asked, a window, shared holders."""
        key = attempt.key
        batch = Batch()
        stop = batch.add("SELECT IS_USED_LOCK(%s)", (f"{key}:{STOP}",), read=value)
        marks = batch.add(MARKS_OF, (key, key), read=rows)
        try:
            session.run(batch)
        except STATEMENT_ERRORS as err:
            if not stop.answered or not tableless(err):  # no marks: no window, no shared holder
                raise
            if attempt.request.hold:  # said before the run, not after: it could not be kept
                raise self.no_marks(HOLD_OPTION, err) from err
        return found_marks(marks.value, stop.value)

    def settle(
        self, session: Session, attempt: Attempt[Session, str, Mode], lock: str, found: Found
    ) -> bool:
        """With *lock* (slot 0) ours, wait out what the grant *found*; False: busy.

        Each wait (`_step`) is followed by a new look; a taker then ends its stop request.
        """
        mode = attempt.state
        taker = mode is not None and mode.stop is not None
        while True:
            if found.swept:
                with contextlib.suppress(*STATEMENT_ERRORS):
                    session.one(SWEEP, (attempt.key, attempt.key))
            waited = self._step(session, attempt, lock, found, taker=taker)
            if waited is None:
                break
            if not waited:
                return False
            attempt.proved = now()
            found = self.look(session, attempt)
        if mode is not None and mode.stop is not None:
            if mode.stop is session:
                attempt.proved = now()
            self.end_stop(mode, attempt.key)
        return True

    def _step(
        self,
        session: Session,
        attempt: Attempt[Session, str, Mode],
        lock: str,
        found: Found,
        *,
        taker: bool,
    ) -> bool | None:
        """Wait once for what *found* says: True once waited, False if busy, None if free.

        A take-over asked after this attempt: give way (`TakenOver`). A window: wait until
        it ends (a piece at a time), holding the slot, so that the queue behind keeps its
        order, unless the deadline comes first; a taker ends it instead. Shared holders,
        for an exclusive request or a taker: wait until each has left.
        """
        if found.stop is not None and not taker:
            if _past(attempt):
                return False  # a try: busy, as if the taker had the lock already
            raise TakenOver(f"taken over by {self.who(session, attempt.key, found.stop)}")
        if found.window and taker:
            session.one(END_WINDOW, (attempt.key,))  # a take-over ends a window
            return True
        if found.window:
            return self._wait_window(session, attempt, lock, found.window)
        if found.readers and (taker or not attempt.request.shared):
            return self._wait_readers(session, attempt, found.readers)
        return None

    def _wait_window(
        self, session: Session, attempt: Attempt[Session, str, Mode], lock: str, window: float
    ) -> bool:
        """Sleep a piece of *window* holding *lock*; False if the deadline comes first."""
        deadline = attempt.deadline
        if deadline is not None and now() + window > deadline:
            return False
        self._sleep(session, lock, min(window, self.server.ttl / 3), attempt)
        return True

    def _wait_readers(
        self, session: Session, attempt: Attempt[Session, str, Mode], readers: Sequence[str]
    ) -> bool:
        """Wait until each shared holder of *readers* has left; False if the deadline comes."""
        for mark in readers:
            reader = f"{attempt.key}:{mark}"
            if _past(attempt):
                return False  # a try, or rows that stay live: busy, never a loop
            if not self.server.wait_for(session, reader, attempt, mark):
                return False
            session.one("SELECT RELEASE_LOCK(%s)", (reader,))
        return True

    def _sleep(
        self, session: Session, lock: str, seconds: float, attempt: Attempt[Session, str, Mode]
    ) -> None:
        """Sleep on the server, holding *lock*: a statement that runs is not idle.

        Named after *lock* with the waiter's comment, so `status` shows a waiter. A KILL
        QUERY ends it early: the caller looks again.
        """
        seconds = max(0.001, seconds)
        statement = f"SELECT SLEEP({seconds:.3f}) AS '{lock}' {attempt.tag}"
        try:
            session.one(statement, timeout=seconds + self.server.timeout)
        except pymysql.err.OperationalError as err:
            if err.args[0] not in CANCELLED:
                raise

    def end_stop(self, mode: Mode, key: str) -> None:
        """End a taker's stop request; `TakenOver` if a later taker got it in the release."""
        stop = f"{key}:{STOP}"
        session, mode.stop = mode.stop, None
        assert session is not None  # noqa: S101 - a taker's
        batch = Batch()
        batch.add("SELECT RELEASE_LOCK(%s)", (stop,))
        newer = batch.add("SELECT IS_USED_LOCK(%s)", (stop,), read=value)
        session.run(batch)
        if newer.value is not None:  # the newest taker wins: this one never ran
            raise TakenOver(f"taken over by {self.who(session, key, newer.value)}")

    # -- who takes over -------------------------------------------------------------------

    def who(self, session: Session, key: str, connection: object) -> str:
        """Name the taker whose session *connection* holds the stop lock of *key*.

        From its row, else from its waiting statement's comment in the processlist (its
        own user's sessions are the ones a user sees there without PROCESS), else by the
        connection. A taker writes its row just after it got the lock: asked again a few
        times, a moment apart, before the connection has to do. Any error is no answer;
        each question waits up to a ttl, as a check does, so that a slow server does not
        make us hang up on a slot we still hold.
        """
        where = f"connection {connection}"
        for again in range(_WHO_TRIES):
            if again:
                time.sleep(_WHO_PAUSE)
            holder = _taker_row(session, key, connection, self.server.ttl)
            if holder is not None:
                return _named(holder)
            holder, seen = _taker_waiting(session, connection, self.server.ttl)
            if holder is not None:
                return _named(holder)
            where = seen or where
        return where


def _reader_batch(attempt: Attempt[Session, str, Mode]) -> tuple[Batch, Reply[Any]]:
    """Start a shared holder's batch: its row, then its lock (whose answer is returned)."""
    request, key = attempt.request, attempt.key
    mark = f"r:{attempt.token}"
    record = json.dumps(request.holder._replace(slot=0, since=time.time()).to_dict())
    batch = Batch()
    batch.add(MARK, (key, mark, request.namespace, request.name, record))
    got = batch.add("SELECT GET_LOCK(%s, 0)", (f"{key}:{mark}",), read=value)
    return batch, got


def unmark(session: Session, key: str, mark: str) -> None:
    """Take back a shared holder's row and lock (best effort on a session that failed)."""
    with contextlib.suppress(*STATEMENT_ERRORS):
        session.one(UNMARK, (key, mark))
    session.one("SELECT RELEASE_LOCK(%s)", (f"{key}:{mark}",))


def _past(attempt: Attempt[Session, str, Mode]) -> bool:
    return attempt.deadline is not None and now() >= attempt.deadline


def _named(holder: Holder) -> str:
    return f"{holder.user}@{holder.host} pid {holder.pid}"


def _taker_row(session: Session, key: str, connection: object, ttl: float) -> Holder | None:
    """Return the record of the stop row of *connection*, if it wrote a good one."""
    with contextlib.suppress(pymysql.err.Error):
        row = session.row(TAKER, (key, connection), timeout=ttl)
        if row is not None:
            with contextlib.suppress(ValueError):
                return Holder.from_dict(read_json(str(row[0])))
    return None


def _taker_waiting(
    session: Session, connection: object, ttl: float
) -> tuple[Holder | None, str | None]:
    """Return the taker its waiting statement's comment names, and its session as seen."""
    with contextlib.suppress(pymysql.err.Error):
        row = session.row(
            "SELECT USER, HOST, INFO FROM information_schema.PROCESSLIST WHERE ID = %s",
            (connection,),
            timeout=ttl,
        )
        if row is not None:
            match = WAITING.fullmatch(str(row[2]))
            who = None if match is None else read_identity(match["json"])
            seen = f"{row[0]}@{row[1]} (connection {connection})"
            return (None if who is None else who.holder), seen
    return None, None
