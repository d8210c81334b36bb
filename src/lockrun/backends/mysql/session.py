"""Sessions on a MySQL or MariaDB server: PyMySQL's connection, bounded, and what fails.

A slot lives with its session: the server frees it when the connection closes, or after the
session idled for its ``wait_timeout``, which is the lease (docs/design.md A7, P21).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final, NoReturn

import pymysql
from pymysql.constants import CLIENT, COMMAND, CR, ER

from lockrun.backends import timeout_for
from lockrun.backends.mysql.batch import Answer, Batch, first_row
from lockrun.backends.mysql.statements import SWEEPS, TABLES, get_lock
from lockrun.errors import BackendUnavailable, ConfigError, LockrunError
from lockrun.timing import now
from lockrun.uri import scrub

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends.mysql.modes import Mode
    from lockrun.backends.mysql.uri import Settings
    from lockrun.backends.sessionlock import Attempt

# The most one answer may bring: a whole packet of the protocol (16 MiB) and some; a
# processlist of some 16000 sessions. More is no server lockrun should trust
# (docs/semantics.md "What bounds a call").
MAX_ANSWER: Final = 17 << 20
# The longest single GET_LOCK wait. Never a negative timeout: MySQL waits forever on one,
# MariaDB returns NULL at once (docs/design.md P20). A wait this long is asked again when it ends.
_FOREVER: Final = 31_536_000
# No table, no fence: the user may not CREATE, there is no database, or the server is read-only.
NO_TABLES: Final = frozenset(
    {
        ER.DBACCESS_DENIED_ERROR,
        ER.TABLEACCESS_DENIED_ERROR,
        ER.NO_DB_ERROR,
        ER.OPTION_PREVENTS_STATEMENT,
        ER.SPECIFIC_ACCESS_DENIED_ERROR,
        ER.OPEN_AS_READONLY,
        ER.CANT_CREATE_TABLE,
        3098,  # ER_BEFORE_DML_VALIDATION_ERROR: Group Replication takes InnoDB tables only
    }
)
# A connection lost or ended under us: server gone, restarted, shutting down, KILLed.
_LOST: Final = frozenset(
    {
        CR.CR_CONN_HOST_ERROR,
        CR.CR_SERVER_GONE_ERROR,
        CR.CR_SERVER_LOST,
        ER.SERVER_SHUTDOWN,
        ER.QUERY_INTERRUPTED,
        1927,  # MariaDB's ER_CONNECTION_KILLED
    }
)
# A statement stopped on the server, its session and locks intact: KILL QUERY, or a DBA's
# max_statement_time (MariaDB) / max_execution_time (MySQL).
CANCELLED: Final = frozenset({ER.QUERY_INTERRUPTED, ER.STATEMENT_TIMEOUT, ER.QUERY_TIMEOUT})
# A server that offers no MEMORY engine (MySQL's disabled_storage_engines, as Group
# Replication advises): lockrun's tables are made in InnoDB instead.
_NO_ENGINE: Final = frozenset({ER.UNKNOWN_STORAGE_ENGINE, 3161})  # ER_DISABLED_STORAGE_ENGINE
# What a statement that needs lockrun's tables may fail with, and so what is caught there.
STATEMENT_ERRORS: Final = (pymysql.err.OperationalError, pymysql.err.ProgrammingError)


class _Connection(pymysql.connections.Connection):
    """PyMySQL's connection, reading each answer within a deadline and a size cap.

    PyMySQL's read timeout bounds each recv, which a server that trickles bytes resets, and
    it reads a reply of many packets whole: `arm` gives the next answer (or the handshake)
    a deadline and `MAX_ANSWER` bytes (docs/semantics.md "What bounds a call").

    And minus 40 ms of loading the system's CA store for nothing: without TLS options
    PyMySQL still tries TLS ("preferred") but verifies nothing, so a bare context does the
    same job (`python -m bench`, section i).
    """

    deadline: float | None = None
    left = MAX_ANSWER
    names: str | None = None  # PyMySQL's SET NAMES, not sent yet (`set_character_set`)
    # Bytes the reader holds in its buffer (`_read_within`), and which reader: TLS makes a new one.
    ahead = 0
    ahead_of: object = None

    def connect(self, sock: socket.socket | None = None) -> None:
        """Connect, with the handshake whole within the connect timeout."""
        self.arm(self.connect_timeout)
        super().connect(sock)

    def arm(self, seconds: float | None) -> None:
        """Give what is read next *seconds* in all (None: no deadline), and the size cap."""
        self.deadline = None if seconds is None else now() + seconds
        self.left = MAX_ANSWER

    def _read_bytes(self, num_bytes: int) -> bytes:
        """Read *num_bytes*, one recv at a time, within the deadline and the cap."""
        self.left -= num_bytes
        if self.left < 0:
            self._lost(f"an answer of more than {MAX_ANSWER} bytes")
        if self.ahead >= num_bytes and self.ahead_of is self._rfile:  # type: ignore[attr-defined]
            self.ahead -= num_bytes  # in the buffer already: no wait, no deadline
            return bytes(self._rfile.read1(num_bytes))  # type: ignore[attr-defined]
        saved = self._sock.gettimeout()  # type: ignore[attr-defined]
        try:
            data, waited = self._read_within(num_bytes, saved)
        except OSError as err:
            self._lost(f"Lost connection to MySQL server during query ({err})", err)
        except BaseException:
            self._force_close()  # type: ignore[attr-defined]
            raise
        if waited and self._sock is not None:  # type: ignore[attr-defined]
            self._sock.settimeout(saved)  # type: ignore[attr-defined]
        if len(data) < num_bytes:
            self._lost("Lost connection to MySQL server during query")
        return bytes(data)

    def _read_within(self, num_bytes: int, saved: float | None) -> tuple[bytearray, bool]:
        """Read up to *num_bytes* before the deadline; fewer if the server hangs up.

        Return them, and whether the socket's timeout was changed. Each wait for the
        socket fills the reader's buffer (one recv of up to its size), so that a reply of
        many small packets (a batch's) costs a recv or two rather than two a packet.
        """
        data = bytearray()
        waited = False
        rfile = self._rfile  # type: ignore[attr-defined]
        while len(data) < num_bytes:
            if self.ahead <= 0 or self.ahead_of is not rfile:
                if self.deadline is not None:
                    left = self.deadline - now()
                    if left <= 0:
                        raise TimeoutError(errno.ETIMEDOUT, "timed out")  # as a recv's
                    self._sock.settimeout(left if saved is None else min(left, saved))  # type: ignore[attr-defined]
                    waited = True
                self.ahead, self.ahead_of = len(rfile.peek(1)), rfile  # at most one recv
                if not self.ahead:
                    break
            chunk = rfile.read1(min(self.ahead, num_bytes - len(data)))
            self.ahead -= len(chunk)
            data += chunk
        return data, waited

    def _lost(self, msg: str, err: OSError | None = None) -> NoReturn:
        """Close at once and raise PyMySQL's error for a lost connection, saying *msg*."""
        self._force_close()  # type: ignore[attr-defined]
        raise pymysql.err.OperationalError(CR.CR_SERVER_LOST, msg) from err

    def set_character_set(self, charset: str, collation: str | None = None) -> None:
        """Keep PyMySQL's ``SET NAMES`` for the session's first query (`Server.session`).

        PyMySQL sends it on its own at connect, a round trip of its own: it goes first in
        the batch of the session's settings instead, before any statement of ours.
        """
        self.names = f"SET NAMES {charset}" + (f" COLLATE {collation}" if collation else "")
        self.charset = charset
        self.encoding = pymysql.charset.charset_by_name(charset).encoding
        self.collation = collation

    def _create_ssl_ctx(self, sslp: object) -> ssl.SSLContext:
        if sslp:
            return super()._create_ssl_ctx(sslp)  # type: ignore[no-any-return,misc]
        return _unverified_context()


@functools.cache
def _unverified_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class Session:
    """One server session, with a timeout per statement and no reconnects, ever."""

    def __init__(self, connection: pymysql.Connection[Any], timeout: float) -> None:
        """Wrap an open *connection* whose statements answer within *timeout* seconds."""
        # Typed Any: the selector wait and per-statement timeouts use PyMySQL's internals.
        self.connection: Any = connection
        self.timeout = timeout
        self.id: int = self.connection.thread_id()  # type: ignore[no-untyped-call]
        self.mariadb = "mariadb" in self.connection.get_server_info().lower()  # type: ignore[no-untyped-call]
        # A proxy may not offer several statements in one query (ProxySQL once did not).
        flags = self.connection.server_capabilities  # type: ignore[attr-defined]
        self.batches = bool(flags & CLIENT.MULTI_STATEMENTS)
        # What one acquisition left for the next step on this session, named by its attempt
        # (never by the session alone: a session may serve many acquisitions).
        self.unchecked: object = None  # the attempt whose check of N goes with its first try
        self.gate_left: object = None  # the attempt whose grant let the gate go already
        # The attempt whose try drew its grant in the same round trip, and what it drew.
        self.drawn: tuple[object, Any] | None = None
        # The attempt whose first try found the lock busy and read who uses it with another
        # N: the check of N, done (and the (slots, holder) row it found, if any).
        self.tried: tuple[object, Any] | None = None

    def fileno(self) -> int:
        """Return the socket's descriptor."""
        return self.connected_socket().fileno()

    def connected_socket(self) -> socket.socket:
        """Return the connection's socket; PyMySQL's error if it is closed."""
        sock: socket.socket | None = self.connection._sock  # noqa: SLF001 - PyMySQL has no accessor
        if sock is None:
            raise pymysql.err.InterfaceError(0, "the session is closed")
        return sock

    def _limit(self, timeout: float | None) -> None:
        # PyMySQL applies its read timeout per recv; the statement's answer gets it in all.
        self.connection._read_timeout = timeout  # noqa: SLF001
        self.connection._write_timeout = self.timeout  # noqa: SLF001
        self.connection.arm(timeout)

    def one(self, sql: str, args: object = None, *, timeout: float | None = 0) -> Any:  # noqa: ANN401 - a column's value
        """Run *sql* and return the first column of its first row (None if no row).

        *timeout* 0 means the session's own; None waits as long as the server takes.
        """
        row = self.row(sql, args, timeout=timeout)
        return None if row is None else row[0]

    def row(self, sql: str, args: object = None, *, timeout: float | None = 0) -> Any:  # noqa: ANN401 - a row
        """Run *sql* and return its first row, or None."""
        self._limit(self.timeout if timeout == 0 else timeout)
        with self.connection.cursor() as cursor:
            cursor.execute(sql, args)
            return cursor.fetchone()

    def rows(self, sql: str, args: object = None) -> tuple[Any, ...]:
        """Run *sql* and return every row."""
        self._limit(self.timeout)
        with self.connection.cursor() as cursor:
            cursor.execute(sql, args)
            return tuple(cursor.fetchall())

    def run(self, batch: Batch, *, timeout: float | None = 0) -> None:
        """Run *batch*'s statements in one round trip; each answer goes to ``batch.answers``.

        The driver puts every args into its sql as an escaped literal, for the session's
        charset and sql_mode, before the statements are joined (tests/hostile/test_sql.py).
        The server stops at the first error, which is raised: ``batch.answers`` then has
        those before it. Without the server's (or a proxy's) leave to batch, one round trip
        a statement. *timeout* as `one`'s.
        """
        batch.answers.clear()
        self._limit(self.timeout if timeout == 0 else timeout)
        with self.connection.cursor() as cursor:
            if not self.batches:
                for sql, args in batch.statements:
                    cursor.execute(sql, args)
                    batch.answers.append(_answer(cursor))
                return
            cursor.execute(";".join(cursor.mogrify(sql, args) for sql, args in batch.statements))
            batch.answers.append(_answer(cursor))
            while cursor.nextset():
                batch.answers.append(_answer(cursor))

    def send(self, sql: str) -> None:
        """Send *sql* without waiting for the answer; `receive` reads it."""
        self._limit(self.timeout)
        self.connection._execute_command(COMMAND.COM_QUERY, sql)  # noqa: SLF001 - see receive

    def receive(self) -> Any:  # noqa: ANN401 - a column's value
        """Read the answer to what `send` sent: the first column of its first row.

        Split from sending so one thread can wait on several sessions with a selector.
        """
        self._limit(self.timeout)  # the socket is readable: the answer is on its way
        self.connection._read_query_result()  # noqa: SLF001
        rows = self.connection._result.rows  # noqa: SLF001
        return rows[0][0] if rows else None

    def close(self) -> None:
        """Say goodbye (COM_QUIT: the server frees our locks) and close; never raises."""
        with contextlib.suppress(pymysql.err.Error, OSError):
            if self.connection.open:
                self.connection.close()

    def hang_up(self) -> None:
        """Cut the connection, even while a statement runs in another thread; never raises.

        shutdown() reaches the server even if other processes (the guardian) share the
        socket; the server then ends the session and frees its locks.
        """
        with contextlib.suppress(pymysql.err.Error, OSError):
            self.connected_socket().shutdown(socket.SHUT_RDWR)

    def abandon(self) -> None:
        """Hang up at once (`hang_up`) and close; never raises."""
        self.hang_up()
        with contextlib.suppress(Exception):
            self.connection._force_close()  # noqa: SLF001 - close() would send COM_QUIT


def _answer(cursor: Any) -> Answer:  # noqa: ANN401 - PyMySQL's cursor
    return Answer(tuple(cursor.fetchall()), int(cursor.lastrowid or 0))


class Server:
    """One MySQL or MariaDB server as lockrun reaches it: sessions, waits, failures."""

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        note: Callable[[str], None],
        cancelled: Callable[[int | str], BackendUnavailable],
    ) -> None:
        """Reach the server of *settings* with sessions whose locks last a lease of *ttl*.

        *note* gets what `-v` shows (no fence, and why); *cancelled* makes the error for a
        wait for a part that was cancelled on the server.
        """
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.timeout = timeout_for(ttl, durable=True)  # for an answer that should come at once
        self.note = note
        self.cancelled = cancelled
        self.checked = False  # whether the server was found usable (not a Galera node)
        self.tables: bool | None = None  # whether lockrun's tables are usable; None: unknown

    def session(self) -> Session:
        """Open a session whose locks the server frees after it idled for a lease."""
        try:
            connection = _Connection(
                **self.settings.kwargs,
                autocommit=True,
                client_flag=CLIENT.MULTI_STATEMENTS,  # docs/design.md A7
                connect_timeout=self.timeout,
                read_timeout=self.timeout,
                write_timeout=self.timeout,
            )
        except pymysql.err.Error as err:
            raise self.failure(err) from err
        except Exception as err:  # PyMySQL's parser choking on a stranger
            msg = f"{self.where} does not answer like a MySQL or MariaDB server"
            raise BackendUnavailable(msg) from err
        session = Session(connection, self.timeout)
        try:
            self._keepalive(session)
            # A stalled holder keeps its locks only as long as its lease (docs/design.md P21); no
            # statement time limit may cut a long GET_LOCK short.
            limit = "max_statement_time" if session.mariadb else "max_execution_time"
            batch = Batch()
            if connection.names is not None:
                batch.add(connection.names)
                connection.names = None
            batch.add(
                f"SET SESSION wait_timeout = {max(1, math.ceil(self.ttl))}, SESSION {limit} = 0"
            )
            self._check(session, batch)  # one round trip for it all
        except pymysql.err.Error as err:
            session.abandon()
            raise self.failure(err) from err
        except BaseException:
            session.abandon()
            raise
        return session

    def _keepalive(self, session: Session) -> None:
        """Let TCP find a vanished server within about a ttl while we wait on it."""
        sock = session.connected_socket()
        if sock.family == socket.AF_UNIX:
            return
        idle = max(1, int(self.ttl / 3))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)

    def _check(self, session: Session, batch: Batch) -> None:
        """Run *batch*, the session's settings; on a first session, refuse a Galera node.

        Its user locks are local to the node (docs/design.md P20).
        """
        wsrep = (
            None if self.checked else batch.add("SHOW VARIABLES LIKE 'wsrep\\_on'", read=first_row)
        )
        session.run(batch)
        row = None if wsrep is None else wsrep.value
        if row is not None and str(row[1]).upper() == "ON":
            msg = (
                f"{self.where} is a Galera cluster node (wsrep_on=ON): its GET_LOCK "
                "locks are local to that node, so lockrun cannot exclude across the cluster; "
                "point --uri at a server outside the cluster"
            )
            raise ConfigError(msg)
        self.checked = True

    def failure(self, err: pymysql.err.Error) -> LockrunError:
        """Translate a PyMySQL error into one line, naming the server but no password."""
        where = self.where
        code = err.args[0] if err.args and isinstance(err.args[0], int) else 0
        text = said(self.settings, err)
        if code == ER.ACCESS_DENIED_ERROR:
            return BackendUnavailable(f"{where}: authentication failed: {text}")
        if code == ER.BAD_DB_ERROR:
            return ConfigError(f"{where}: no such database on this server: {text}")
        if code == ER.CON_COUNT_ERROR:
            return BackendUnavailable(
                f"{where}: the server has no free connection (max_connections): {text}"
            )
        if "timed out" in text:
            return BackendUnavailable(f"{where}: no answer within {self.timeout:g}s ({text})")
        if isinstance(err, pymysql.err.InternalError) and "sequence" in text:
            return BackendUnavailable(f"{where} does not answer like a MySQL or MariaDB server")
        return BackendUnavailable(f"{where}: {text}")

    def wait_limits(self, seconds: float | None) -> tuple[float, float | None]:
        """Return GET_LOCK's timeout for a wait of *seconds*, and the patience for its answer.

        None waits a year, as long as it takes to answer; else the answer gets the
        connection's timeout beyond the wait.
        """
        if seconds is None:
            return _FOREVER, None
        return seconds, seconds + self.timeout

    def get(
        self,
        session: Session,
        lock: str,
        seconds: float | None,
        attempt: Attempt[Session, str, Mode],
        part: int | str,
    ) -> bool:
        """Wait up to *seconds* (None: a year) in GET_LOCK for *lock*; True if ours."""
        limit, patience = self.wait_limits(seconds)
        tag = attempt.tag if limit else ""  # for `status`, which never sees a try that cannot wait
        got = session.one(get_lock(lock, limit, tag), timeout=patience)
        if got is None:  # KILL QUERY from outside, or an error
            raise self.cancelled(part)
        return bool(got == 1)

    def wait_for(
        self, session: Session, lock: str, attempt: Attempt[Session, str, Mode], part: str
    ) -> bool:
        """Wait in *lock*'s queue until it is ours (True) or the attempt's deadline passes."""
        deadline = attempt.deadline
        while True:
            remaining = None if deadline is None else max(0.0, deadline - now())
            attempt.queued = attempt.queued or remaining != 0
            if self.get(session, lock, remaining, attempt, part):
                return True
            if deadline is not None and now() >= deadline:
                return False


def said(settings: Settings, err: pymysql.err.Error) -> str:
    """Return what PyMySQL or the server said of *err*, in one line, with no secret.

    Never empty: PyMySQL raises ``InterfaceError(0, '')`` for a connection it closed
    already (after a lost one), and a server may send an error with no text.
    """
    text = " ".join((str(err.args[1]) if len(err.args) > 1 else str(err)).split())
    if not text.strip("() "):
        code = err.args[0] if err.args else None
        closed = isinstance(err, pymysql.err.InterfaceError) and code in {0, None}
        number = "" if code in {0, None} else f" {code}"
        text = "the connection was already closed" if closed else f"{type(err).__name__}{number}"
        text += " (no message)"
    return scrub(text, settings.secrets)


def make_tables(session: Session) -> None:
    """Create lockrun's tables that are missing; in InnoDB where MEMORY is not offered."""
    for statement in TABLES:
        try:
            session.one(statement)
        except pymysql.err.Error as err:
            if not err.args or err.args[0] not in _NO_ENGINE:
                raise
            session.one(statement.replace("ENGINE=MEMORY", "ENGINE=InnoDB"))


def sweep(session: Session) -> None:
    """Delete the rows of lockrun's tables in memory that no longer count (`SWEEPS`)."""
    for statement in SWEEPS:
        session.one(statement)


def tableless(err: pymysql.err.Error) -> bool:
    """Whether *err* says lockrun's tables are missing or out of reach."""
    code = err.args[0] if err.args else None
    return code in NO_TABLES or code == ER.NO_SUCH_TABLE


def transient(err: BaseException | None) -> bool:
    """Whether *err* is a lost connection that a waiter may ride out (not a refusal)."""
    if isinstance(err, BackendUnavailable):
        return "cancelled on the server" in str(err) or transient(err.__cause__)
    return isinstance(err, pymysql.err.OperationalError) and err.args[0] in _LOST
