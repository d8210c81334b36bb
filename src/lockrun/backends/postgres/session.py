"""One PostgreSQL server session, driven through libpq's asynchronous calls (psycopg 3)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
from typing import TYPE_CHECKING, Final, TypeAlias

import psycopg
from psycopg import pq

from lockrun.errors import BackendUnavailable
from lockrun.timing import now

from .uri import refusal

if TYPE_CHECKING:
    from lockrun.backends import Holder

Row: TypeAlias = tuple[str | None, ...]  # a row as libpq gives it: text, or None for NULL

_LONGEST_POLL: Final = 86400.0  # s: a poll(2) longer than this is made of several
# SQLSTATEs
LOCK_NOT_AVAILABLE: Final = "55P03"  # lock_timeout
QUERY_CANCELED: Final = "57014"
NOT_ALLOWED: Final = frozenset({"42501", "42883"})  # insufficient privilege, no such function
UNDEFINED_TABLE: Final = "42P01"
DUPLICATE: Final = "23505"  # two sessions creating the table at once
# A session ended under us: server shut down or restarted, backend terminated, idle too long.
_ENDED: Final = frozenset({"57P01", "57P02", "57P03", "57P05"})
NO_ANSWER: Final = "the server sent no answer"


class PgError(Exception):
    """A statement failed; *sqlstate* is None when the connection itself failed."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        """Keep the server's one-line *message* and its SQLSTATE."""
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate
        # The rows of the statements of a `send_simple` that ran before the one that failed.
        self.answers: list[list[Row]] = []


class NoAnswer(PgError):
    """A statement got no answer in time; the session is no longer usable."""


def _ready(fd: int, timeout: float | None, events: int = select.POLLIN) -> bool:
    """Return whether *fd* is ready for *events* (or hung up) within *timeout* seconds."""
    poller = select.poll()
    poller.register(fd, events)
    if timeout is None:
        return bool(poller.poll())
    deadline = now() + timeout
    while True:  # poll(2) takes at most 2^31 ms (24.8 days): a long wait goes in pieces
        if poller.poll(max(0.0, min(deadline - now(), _LONGEST_POLL)) * 1000):
            return True
        if now() >= deadline:
            return False


class Session:
    """One server session, spoken to through libpq's asynchronous calls, never reconnected.

    psycopg's cursors block without a timeout; libpq's own send/receive lets every
    statement have one, and lets the head of a queue wait on several sessions at once.
    """

    def __init__(self, connection: psycopg.Connection[tuple[object, ...]], tag: str) -> None:
        """Wrap an open *connection*; every statement carries *tag* (who runs it)."""
        self.connection = connection
        self.pgconn = connection.pgconn
        self.tag = tag
        self.holder: Holder | None = None  # whom a grant named the holder, from then on
        self.pid = 0  # the server process, as pg_backend_pid() says (a pooler hides it)
        self.stopping = False  # whether it holds the stop key of a name (a taker, waiting)
        self.listening = ""  # the channel it listens on for take-overs (a holder's, a try's)
        self.windowed = ""  # whether the read of windows is prepared (lockrun_window)
        # The (name, N) lock this session holds once, taken by a grant whose check found no
        # user of another N, and kept from grant to grant: a user of another N who comes
        # later sees it in its own check, so ours need not look again (docs/design.md A8).
        # None: the release lets go of everything (pg_advisory_unlock_all).
        self.agreed: tuple[int, int] | None = None
        # Whether this session's last one-slot acquisition found the slot taken: its next
        # waits at once, the try in the wait's statement (`grant.wait_and_grant`).
        self.contended = False
        # Whether a statement that failed, or a second grant, may have taken a lock twice:
        # then the release lets go of everything.
        self.tangled = False
        # The statements this session prepared (`prepared`): text → name; *shapes* counts
        # the failures after which whether they are is unknown (new names, then).
        self.statements: dict[str, str] = {}
        self.shapes = 0

    def fileno(self) -> int:
        """Return the socket's descriptor; `PgError` once libpq has closed it."""
        try:
            return self.pgconn.socket
        except psycopg.OperationalError as err:  # the connection is lost
            raise PgError(first_line(str(err))) from err

    def send(self, sql: str, *params: object) -> None:
        """Send *sql* ($1, $2 … for *params*, as text) without waiting for the answer."""
        try:
            values = [None if value is None else str(value).encode() for value in params]
            # The tag first: pg_stat_activity keeps only the first 1024 bytes.
            self.pgconn.send_query_params(f"{self.tag} {sql}".encode(), values or None)
            self._flush()
        except psycopg.OperationalError as err:
            raise PgError(first_line(str(err))) from err

    def send_simple(self, *statements: str) -> None:
        """Send *statements* in one message, run in order in one transaction (values inline).

        One round trip where each would take its own; `answers` reads their rows.
        """
        try:
            self.pgconn.send_query(f"{self.tag} {'; '.join(statements)}".encode())
            self._flush()
        except psycopg.OperationalError as err:
            raise PgError(first_line(str(err))) from err

    def _flush(self) -> None:
        while self.pgconn.flush():  # rarely: a statement larger than the socket takes
            if not _ready(self.fileno(), 5.0, select.POLLOUT):
                msg = "the server takes no more of our statement"
                raise NoAnswer(msg)

    def prepared(self, sql: str, types: str, values: str) -> list[str]:
        """Return the statements that run *sql* ($1 … of *types*) with *values*, prepared.

        The first use on this session prepares it, in the same message. A failed message
        leaves unknown whether its PREPARE ran: `unsure` makes the next use prepare anew.
        """
        name = self.statements.get(sql)
        if name is not None:
            return [f"EXECUTE {name}({values})"]
        name = f"lockrun_{self.shapes}_{len(self.statements)}"
        self.statements[sql] = name
        return [f"PREPARE {name}({types}) AS {sql}", f"EXECUTE {name}({values})"]

    def unsure(self) -> None:
        """Forget which statements are prepared: a message that prepared one failed."""
        self.statements.clear()
        self.shapes += 1

    def literal(self, text: str) -> str:
        """Return *text* quoted as a SQL string literal, as libpq escapes it for the server."""
        try:
            return bytes(pq.Escaping(self.pgconn).escape_literal(text.encode())).decode()
        except psycopg.OperationalError as err:
            raise PgError(first_line(str(err))) from err

    def ready(self) -> bool:
        """Read what arrived; return whether the whole answer is in (never blocks)."""
        try:
            self.pgconn.consume_input()
        except psycopg.OperationalError as err:
            raise PgError(first_line(str(err))) from err
        return not self.pgconn.is_busy()

    def receive(self, timeout: float | None) -> list[Row]:
        """Wait up to *timeout* seconds (None: as long as it takes) for the rows of `send`."""
        answers = self.answers(timeout)
        return answers[-1] if answers else []

    def answers(self, timeout: float | None) -> list[list[Row]]:
        """Wait as `receive` does; return the rows of each statement of `send_simple`.

        The first statement that failed is raised (`PgError`, its ``answers`` the rows of
        those before it) once the whole answer is read, so the session stays usable.
        """
        deadline = None if timeout is None else now() + timeout
        answers: list[list[Row]] = []
        error: PgError | None = None
        while (result := self._result(deadline, timeout)) is not None:
            if result.status == pq.ExecStatus.TUPLES_OK:
                answers.append(_rows(result))
            elif result.status == pq.ExecStatus.FATAL_ERROR and not (error and error.sqlstate):
                error = _error(result)
        if error is not None:
            error.answers = answers
            raise error
        if self.pgconn.status != pq.ConnStatus.OK:
            raise PgError(first_line(self.pgconn.get_error_message() or "the connection ended"))
        return answers

    def _result(self, deadline: float | None, timeout: float | None) -> pq.abc.PGresult | None:
        """Return libpq's next result once it is in by *deadline*; None after the last."""
        while self.pgconn.is_busy():  # get_result would block: wait for more, in time
            left = None if deadline is None else deadline - now()
            if (left is not None and left <= 0) or not _ready(self.fileno(), left):
                raise NoAnswer(f"no answer within {timeout:g}s")
            self.ready()
        return self.pgconn.get_result()

    def rows(self, sql: str, *params: object, timeout: float | None) -> list[Row]:
        """Run *sql* and return every row."""
        self.send(sql, *params)
        return self.receive(timeout)

    def one(self, sql: str, *params: object, timeout: float | None) -> str | None:
        """Run *sql* and return the first column of its first row (None if no row)."""
        rows = self.rows(sql, *params, timeout=timeout)
        return rows[0][0] if rows else None

    def close(self) -> None:
        """Say goodbye: the server ends the session and frees its locks; never raises."""
        with contextlib.suppress(Exception):
            self.connection.close()

    def hang_up(self) -> None:
        """Cut the connection, even while a statement waits in another thread; never raises.

        shutdown() reaches the server even if other processes (the guardian) share the
        socket; the server then ends the session and frees its locks. libpq's connection
        stays allocated for the thread that may be inside it: `close` frees it.
        """
        with (
            contextlib.suppress(OSError, PgError),
            socket.socket(fileno=os.dup(self.fileno())) as sock,
        ):
            sock.shutdown(socket.SHUT_RDWR)

    def heard(self) -> set[int]:
        """Take the notifications libpq has read: return the server pids that sent them."""
        pids = set()
        while (notification := self.pgconn.notifies()) is not None:
            pids.add(notification.be_pid)
        return pids

    def abandon(self) -> None:
        """Hang up at once and close; never raises. Only from the thread that uses it."""
        self.hang_up()
        self.close()


def _rows(result: pq.abc.PGresult) -> list[Row]:
    """Return a result's rows as text."""
    return [
        tuple(_text(result.get_value(row, col)) for col in range(result.nfields))
        for row in range(result.ntuples)
    ]


def _error(result: pq.abc.PGresult) -> PgError:
    """Return a failed result's message and SQLSTATE as a `PgError`."""
    state = result.error_field(pq.DiagnosticField.SQLSTATE)
    text = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
    message = first_line(text or result.error_message or b"the statement failed")
    return PgError(message, state.decode(errors="replace") if state else None)


def results(session: Session, timeout: float | None) -> tuple[list[list[Row]], PgError | None]:
    """Return the rows of a `send_simple`'s statements up to one that failed, and its error.

    A lost connection (no SQLSTATE) or no answer in time is raised: the session is gone.
    """
    try:
        return session.answers(timeout), None
    except NoAnswer:
        raise
    except PgError as err:
        if err.sqlstate is None:
            raise
        return err.answers, err


def transient(err: BaseException | None) -> bool:
    """Whether *err* is a lost connection that a waiter may ride out (not a refusal).

    A server that restarts refuses connections, or says it is starting up, for a while.
    """
    if isinstance(err, BackendUnavailable):
        return "cancelled on the server" in str(err) or transient(err.__cause__)
    if isinstance(err, psycopg.OperationalError):
        return refusal("", str(err)) is None
    return (
        isinstance(err, PgError)
        and not isinstance(err, NoAnswer)
        # a statement a DBA cancelled: the session lives, ask again (as MySQL's KILL QUERY)
        and (err.sqlstate is None or err.sqlstate in _ENDED or err.sqlstate == QUERY_CANCELED)
    )


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode(errors="replace")


def first_line(text: str | bytes) -> str:
    """Return a server's or libpq's message in one line, without its severity."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return " ".join(text.split()).removeprefix("ERROR: ").removeprefix("FATAL: ")
