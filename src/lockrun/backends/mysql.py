"""MySQL and MariaDB: user locks (GET_LOCK) as a first-in first-out semaphore.

docs/design.md A6 and A7 give the reasons behind this design.

Names are digests, so a lock is the same on MySQL and MariaDB whatever the name's length,
case or characters: ``lr:`` and 40 hex digits of SHA-256(namespace NUL name), then ``:0`` …
``:N-1`` for the slots and ``:gate`` for the queue of a semaphore.

The semaphore is `lockrun.backends.sessionlock`'s, on GET_LOCK, which the server grants in
arrival order; the head of a semaphore's queue KILLs its losing helper sessions.

A slot lives with its session: the server frees it when the connection closes, or after the
session idled for its ``wait_timeout``, which is the lease. The holder proves ownership every
ttl/3 with ``IS_USED_LOCK(slot) = CONNECTION_ID()`` and never reconnects: a session that
failed once has lost its locks (docs/design.md P19).

The modes (docs/design.md A7) add ``KEY:r:TOKEN`` for each shared holder, ``KEY:stop`` for a
take-over request, and rows in lockrun_marks: hold windows on the server's clock, shared
holders, who takes over.
"""

from __future__ import annotations

import configparser
import contextlib
import decimal
import errno
import functools
import hashlib
import json
import math
import os
import re
import socket
import ssl
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pymysql
from pymysql.constants import CLIENT, COMMAND, CR, ER

from lockrun.backends import (
    Holder,
    LockState,
    Request,
    host_port,
    read_identity,
    read_json,
    readable_file,
    slots_mismatch,
    timeout_for,
)
from lockrun.backends.sessionlock import GATE, Attempt, SessionLease, SessionLockBackend
from lockrun.bounds import MAX_FENCE, MAX_SLOTS, MAX_WAIT
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    LockrunError,
    TakenOver,
)
from lockrun.timing import DEFAULT_TTL, now
from lockrun.uri import (
    Secrets,
    option_name,
    query_items,
    scrub,
    secrets_of,
    unquote,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from lockrun.uri import LockURI

_OPTIONS: Final = frozenset(
    {"unix_socket", "ssl_ca", "ssl_cert", "ssl_key", "read_default_file", "charset"}
)
_FILES: Final = frozenset({"ssl_ca", "ssl_cert", "ssl_key", "read_default_file"})
_TLS: Final = frozenset({"ssl_ca", "ssl_cert", "ssl_key"})
# The longest single GET_LOCK wait. Never a negative timeout: MySQL waits forever on one,
# MariaDB returns NULL at once (docs/design.md P20). A wait this long is asked again when it ends.
# The most one answer may bring: a whole packet of the protocol (16 MiB) and some; a
# processlist of some 16000 sessions. More is no server lockrun should trust
# (docs/semantics.md "What bounds a call").
MAX_ANSWER: Final = 17 << 20
_FOREVER: Final = 31_536_000
_PROBED_SLOTS: Final = 64  # `status` looks at this many slots when it cannot learn N
FENCES: Final = "lockrun_fence"
HOLDERS: Final = "lockrun_holders"
_HOLD_OPTION: Final = "--hold-at-least"
MARKS: Final = "lockrun_marks"  # hold windows, shared holders, take-over requests
_TABLES: Final = (
    f"""CREATE TABLE IF NOT EXISTS {FENCES} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
      fence BIGINT UNSIGNED NOT NULL
    ) ENGINE=InnoDB""",
    f"""CREATE TABLE IF NOT EXISTS {HOLDERS} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      slot INT UNSIGNED NOT NULL,
      slots INT UNSIGNED NOT NULL,
      connection_id BIGINT UNSIGNED NOT NULL,
      namespace VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      holder TEXT CHARACTER SET utf8mb4 NOT NULL,
      PRIMARY KEY (lock_key, slot)
    ) ENGINE=InnoDB""",
    # One row per lock and mark: ``hold``, a --hold-at-least window ending at until_us (the
    # server's Unix time in µs); ``r:TOKEN``, a --shared holder of GET_LOCK KEY:r:TOKEN;
    # ``stop``, a --take-over request of the holder of KEY:stop (docs/design.md A7).
    f"""CREATE TABLE IF NOT EXISTS {MARKS} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      mark VARCHAR(24) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      connection_id BIGINT UNSIGNED NOT NULL,
      until_us BIGINT NOT NULL DEFAULT 0,
      namespace VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      holder TEXT CHARACTER SET utf8mb4 NOT NULL,
      PRIMARY KEY (lock_key, mark)
    ) ENGINE=InnoDB""",
)
# The server's clock in µs seeds the fence, so it keeps rising if the table is ever lost.
_MICROS: Final = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)"
# A counter at or past 2^63 - 1 is one lockrun never wrote (fence + 1 would overflow):
# it counts as lost, and the clock seeds the fence again.
_NEXT_FENCE: Final = (
    f"INSERT INTO {FENCES} (lock_key, fence) VALUES (%s, LAST_INSERT_ID({_MICROS})) "
    f"ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(IF(fence >= {MAX_FENCE}, {_MICROS}, "
    f"GREATEST(fence + 1, {_MICROS})))"
)
_RECORD: Final = (
    f"REPLACE INTO {HOLDERS} (lock_key, slot, slots, connection_id, namespace, name, holder) "
    "VALUES (%s, %s, %s, CONNECTION_ID(), %s, %s, %s)"
)
_FORGET: Final = (
    f"DELETE FROM {HOLDERS} WHERE lock_key = %s AND slot = %s AND connection_id = CONNECTION_ID()"
)
# A live holder of the name with another N (its session still holds the slot it recorded).
_MISMATCH: Final = (
    f"SELECT slots, holder FROM {HOLDERS} WHERE lock_key = %s AND slots <> %s "
    f"AND slots BETWEEN 1 AND {MAX_SLOTS} "  # a row lockrun could have written
    "AND IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id LIMIT 1"
)
# The server's clock as Unix time in µs, free of the session's time zone (UNIX_TIMESTAMP of
# NOW() repeats an hour when daylight saving time ends). One value for a whole statement.
_NOW_US: Final = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
# A window read back is cut to the longest one lockrun writes: a forged until_us of the year
# 9999 keeps a lock busy no longer than a --hold-at-least could (and never overflows).
_MAX_HOLD_US: Final = int(MAX_WAIT * 1_000_000)
_HOLD: Final = "hold"
_STOP: Final = "stop"
# A taker writes its row a moment after it got the stop lock: who it is is asked this often.
_WHO_TRIES: Final = 3
_WHO_PAUSE: Final = 0.05
_READER: Final = re.compile(r"r:[0-9a-f]{16}")  # the mark of a shared holder of ours
# Whether a reader's row is live: its session holds its lock (NULL, not live, where either
# is NULL). The name is made of our key and a mark of 18 characters, so no row can make
# GET_LOCK's name too long (1059).
_LIVE_READER: Final = (
    "CASE WHEN mark LIKE 'r:%%' AND CHAR_LENGTH(mark) = 18 "
    "THEN IS_USED_LOCK(CONCAT(%s, ':', mark)) = connection_id END"
)
# The window left (µs, 0 … _MAX_HOLD_US) and the shared holders of a lock, live or not (the
# dead are swept), with their records and the server's time. Read in a statement of its
# own after the slot is ours, so that it sees every mark committed before the slot was free.
_MARKS_OF: Final = (
    f"SELECT mark, connection_id, "
    f"LEAST(GREATEST(until_us, {_NOW_US}), {_NOW_US} + {_MAX_HOLD_US}) - {_NOW_US}, "
    f"{_LIVE_READER}, holder, {_NOW_US} FROM {MARKS} WHERE lock_key = %s "
    f"AND (mark = '{_HOLD}' AND until_us > {_NOW_US} OR mark LIKE 'r:%%') ORDER BY mark LIMIT 1000"
)
_SWEEP: Final = (  # the rows of shared holders whose sessions ended without a goodbye
    f"DELETE FROM {MARKS} WHERE lock_key = %s AND mark LIKE 'r:%%' "
    f"AND NOT COALESCE({_LIVE_READER}, 0)"
)
_MARK: Final = (
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "
    "VALUES (%s, %s, CONNECTION_ID(), 0, %s, %s, %s)"
)
_UNMARK: Final = (
    f"DELETE FROM {MARKS} WHERE lock_key = %s AND mark = %s AND connection_id = CONNECTION_ID()"
)
_WINDOW: Final = (
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "
    f"VALUES (%s, '{_HOLD}', CONNECTION_ID(), {_NOW_US} + %s, %s, %s, %s)"
)
_END_WINDOW: Final = f"DELETE FROM {MARKS} WHERE lock_key = %s AND mark = '{_HOLD}'"
_STOP_MARK: Final = (  # only by the session that got the stop lock: who asks, for the message
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "
    f"SELECT %s, '{_STOP}', CONNECTION_ID(), 0, %s, %s, %s FROM DUAL "
    "WHERE IS_USED_LOCK(%s) = CONNECTION_ID()"
)
_TAKER: Final = (
    f"SELECT holder FROM {MARKS} WHERE lock_key = %s AND mark = '{_STOP}' AND connection_id = %s"
)
# A live shared holder, for a user of N > 1: readers are users of one slot.
_SHARED_MISMATCH: Final = (
    f"SELECT 1, holder FROM {MARKS} WHERE lock_key = %s AND mark LIKE 'r:%%' "
    f"AND {_LIVE_READER} LIMIT 1"
)
# No table, no fence: the user may not CREATE, there is no database, or the server is read-only.
_NO_TABLES: Final = frozenset(
    {
        ER.DBACCESS_DENIED_ERROR,
        ER.TABLEACCESS_DENIED_ERROR,
        ER.NO_DB_ERROR,
        ER.OPTION_PREVENTS_STATEMENT,
        ER.SPECIFIC_ACCESS_DENIED_ERROR,
        ER.OPEN_AS_READONLY,
        ER.CANT_CREATE_TABLE,
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
_CANCELLED: Final = frozenset({ER.QUERY_INTERRUPTED, ER.STATEMENT_TIMEOUT, ER.QUERY_TIMEOUT})
# What a waiter puts after its GET_LOCK, for `lockrun status` to read in the processlist.
# A waiter waits in GET_LOCK for a slot, the gate, a take-over's stop lock or a shared
# holder to leave; or sleeps, holding slot 0, until a hold window ends (named by its column).
_WAITING: Final = re.compile(
    r"SELECT (?:GET_LOCK\(|SLEEP\([0-9.]+\) AS )"
    r"'(?P<key>lr:[0-9a-f]{40}):(?P<part>gate|\d+|stop|r:[0-9a-f]{16})'(?:, [0-9.]+\))? "
    r"/\* lockrun (?P<json>\{.*\}) \*/",
    re.DOTALL,
)


class Settings(NamedTuple):
    """Where the server is and how to log in, from a mysql: or mariadb: URI."""

    where: str  # the URI without its password, for messages
    kwargs: Mapping[str, Any]  # for pymysql.connect
    secrets: Secrets  # what PyMySQL's and the server's words must never show


def parse(uri: LockURI) -> Settings:
    """Translate a lock URI into PyMySQL settings; raise `ConfigError` for a bad one."""
    query = query_items(uri.query)
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS))
        name = option_name(unknown[0], uri.query)
        msg = f"{uri.redacted}: unknown option {name} (allowed: {allowed})"
        raise ConfigError(msg)
    _check_files(uri, query)
    username, _, password = (uri.userinfo or "").partition(":")
    hosts = uri.hosts
    database = uri.path.strip("/")
    if "/" in database:
        msg = f"{uri.redacted}: expected mysql://[USER[:PASSWORD]@]HOST[:PORT][/DATABASE]"
        raise ConfigError(msg)
    kwargs: dict[str, object] = {
        "user": unquote(username) or None,
        "password": unquote(password),
        "database": database or None,
        "charset": query.pop("charset", "utf8mb4"),
    }
    if hosts:
        host, port = host_port(uri, hosts, 0)  # no port: the option file's, else 3306
        kwargs["host"] = host
        if port:
            kwargs["port"] = port
    kwargs |= {option: value for option, value in query.items() if value}
    if "ssl_ca" in kwargs:  # a CA to check the server against: check its name too
        kwargs["ssl_verify_identity"] = True
    _check_tls(uri, kwargs)
    charset = str(kwargs["charset"])
    with contextlib.suppress(KeyError):  # PyMySQL returns None for an unknown one, or raised
        if pymysql.charset.charset_by_name(charset) is not None:
            return Settings(uri.redacted, kwargs, secrets_of(uri.text))
    msg = f"{uri.redacted}: unknown charset {charset!r}"
    raise ConfigError(msg)


def _check_files(uri: LockURI, query: dict[str, str]) -> None:
    """Expand ``~`` in the file options and make sure each names a readable file."""
    for option in sorted(_FILES & set(query)):
        path = query[option] = os.path.expanduser(query[option])
        if not readable_file(path):
            msg = f"{uri.redacted}: {option} {path}: no such readable file"
            raise ConfigError(msg)
    if "read_default_file" in query:
        _check_option_file(uri, query["read_default_file"])


def _check_option_file(uri: LockURI, path: str) -> None:
    """Refuse an option file PyMySQL cannot read, naming the line but none of its text."""
    parser = configparser.RawConfigParser(strict=False, allow_no_value=True)
    try:
        parser.read(path)
    except configparser.Error as err:
        line = getattr(err, "lineno", None)
        where = f" line {line}" if line else ""
        msg = f"{uri.redacted}: read_default_file {path}{where}: not a MySQL option file"
        raise ConfigError(msg) from None


def _check_tls(uri: LockURI, kwargs: Mapping[str, object]) -> None:
    """Load the TLS files now, so a bad one is a configuration error (78), not the server's.

    Without TLS options there is nothing to load: the system's CA store costs 20–40 ms,
    which PyMySQL's "preferred" TLS never uses (`_Connection`).
    """
    if not _TLS & set(kwargs):
        return
    if "ssl_key" in kwargs and "ssl_cert" not in kwargs:
        msg = f"{uri.redacted}: ssl_key needs ssl_cert (the client certificate it belongs to)"
        raise ConfigError(msg)
    option = "ssl_ca"
    try:
        context = ssl.create_default_context(cafile=kwargs.get("ssl_ca"))  # type: ignore[arg-type]
        if "ssl_cert" in kwargs:
            option = "ssl_cert"
            context.load_cert_chain(kwargs["ssl_cert"], kwargs.get("ssl_key"))  # type: ignore[arg-type]
    except (ssl.SSLError, OSError) as err:
        reason = getattr(err, "reason", None) or err.strerror or type(err).__name__
        msg = f"{uri.redacted}: {option} {kwargs.get(option)}: unusable ({reason})"
        raise ConfigError(msg) from None


def lock_key(namespace: str, name: str) -> str:
    r"""Return the GET_LOCK name of (namespace, name) without its ``:slot`` or ``:gate``.

    In SQL: ``CONCAT('lr:', LEFT(SHA2(CONCAT(namespace, '\0', name), 256), 40))``.
    """
    digest = hashlib.sha256(f"{namespace}\0{name}".encode()).hexdigest()
    return f"lr:{digest[:40]}"


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,  # noqa: ARG001 - nothing to warn of yet
    note: Callable[[str], None] | None = None,
) -> MySQLBackend:
    """Check *uri*; sessions are opened on use, with timeouts that fit leases of *ttl*."""
    return MySQLBackend(parse(uri), ttl or DEFAULT_TTL, note or (lambda _line: None))


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
            self._force_close()  # type: ignore[attr-defined]
            raise pymysql.err.OperationalError(
                CR.CR_SERVER_LOST, f"an answer of more than {MAX_ANSWER} bytes"
            )
        data = bytearray()
        saved = self._sock.gettimeout()  # type: ignore[attr-defined]
        try:
            while len(data) < num_bytes:
                if self.deadline is not None:
                    left = self.deadline - now()
                    if left <= 0:
                        raise TimeoutError(errno.ETIMEDOUT, "timed out")  # noqa: TRY301 - as a recv's
                    self._sock.settimeout(left if saved is None else min(left, saved))  # type: ignore[attr-defined]
                chunk = self._rfile.read1(num_bytes - len(data))  # type: ignore[attr-defined]
                if not chunk:
                    break
                data += chunk
        except OSError as err:
            self._force_close()  # type: ignore[attr-defined]
            msg = f"Lost connection to MySQL server during query ({err})"
            raise pymysql.err.OperationalError(CR.CR_SERVER_LOST, msg) from err
        except BaseException:
            self._force_close()  # type: ignore[attr-defined]
            raise
        if self._sock is not None:  # type: ignore[attr-defined]
            self._sock.settimeout(saved)  # type: ignore[attr-defined]
        if len(data) < num_bytes:
            self._force_close()  # type: ignore[attr-defined]
            msg = "Lost connection to MySQL server during query"
            raise pymysql.err.OperationalError(CR.CR_SERVER_LOST, msg)
        return bytes(data)

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


class Answer(NamedTuple):
    """What the server answered to one statement of a batch."""

    rows: tuple[Any, ...]
    last_id: int  # LAST_INSERT_ID() as the statement's OK packet reported it


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

    def fileno(self) -> int:
        """Return the socket's descriptor."""
        return self._socket().fileno()

    def _socket(self) -> socket.socket:
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

    def batch(self, statements: Sequence[tuple[str, object]], answers: list[Answer]) -> None:
        """Run (sql, args) *statements* in one round trip, appending each one's answer.

        The driver puts every args into its sql as an escaped literal, for the session's
        charset and sql_mode, before the statements are joined (tests/hostile/test_sql.py).
        The server stops at the first error, which is raised: *answers* has those before it.
        Without the server's (or a proxy's) leave to batch, one round trip a statement.
        """
        self._limit(self.timeout)
        with self.connection.cursor() as cursor:
            if not self.batches:
                for sql, args in statements:
                    cursor.execute(sql, args)
                    answers.append(Answer(tuple(cursor.fetchall()), int(cursor.lastrowid or 0)))
                return
            cursor.execute(";".join(cursor.mogrify(sql, args) for sql, args in statements))
            answers.append(Answer(tuple(cursor.fetchall()), int(cursor.lastrowid or 0)))
            while cursor.nextset():
                answers.append(Answer(tuple(cursor.fetchall()), int(cursor.lastrowid or 0)))

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
            self._socket().shutdown(socket.SHUT_RDWR)

    def abandon(self) -> None:
        """Hang up at once (`hang_up`) and close; never raises."""
        self.hang_up()
        with contextlib.suppress(Exception):
            self.connection._force_close()  # noqa: SLF001 - close() would send COM_QUIT


class MySQLBackend(SessionLockBackend[Session]):
    """Sessions on one MySQL or MariaDB server."""

    errors = (pymysql.err.Error,)
    waits = "GET_LOCK"

    def __init__(self, settings: Settings, ttl: float, note: Callable[[str], None]) -> None:
        """Remember *settings*; *note* gets what `-v` shows (no fence, and why)."""
        super().__init__()
        self.settings = settings
        # Python's codec for the URI's charset (`parse` checked that PyMySQL knows it).
        self.encoding: str = pymysql.charset.charset_by_name(
            str(settings.kwargs["charset"])
        ).encoding
        self.where = settings.where
        self.ttl = ttl
        self.note = note
        self.timeout = timeout_for(ttl, durable=True)
        self.checked = False  # whether the server was found usable (not a Galera node)
        self.tables: bool | None = None  # whether lockrun's tables are usable; None: unknown

    # -- sessions ------------------------------------------------------------------------

    def session(self) -> Session:
        """Open a session whose locks the server frees after it idled for a lease."""
        where = self.settings.where
        try:
            connection = _Connection(
                **self.settings.kwargs,
                autocommit=True,
                client_flag=CLIENT.MULTI_STATEMENTS,  # the grant in one round trip (_grant)
                connect_timeout=self.timeout,
                read_timeout=self.timeout,
                write_timeout=self.timeout,
            )
        except pymysql.err.Error as err:
            raise self.failure(err) from err
        except Exception as err:  # PyMySQL's parser choking on a stranger
            msg = f"{where} does not answer like a MySQL or MariaDB server"
            raise BackendUnavailable(msg) from err
        session = Session(connection, self.timeout)
        try:
            self._keepalive(session)
            # A stalled holder keeps its locks only as long as its lease (docs/design.md P21); no
            # statement time limit may cut a long GET_LOCK short.
            limit = "max_statement_time" if session.mariadb else "max_execution_time"
            session.row(
                f"SET SESSION wait_timeout = {max(1, math.ceil(self.ttl))}, SESSION {limit} = 0"
            )
            if not self.checked:
                self._check(session)
        except pymysql.err.Error as err:
            session.abandon()
            raise self.failure(err) from err
        except BaseException:
            session.abandon()
            raise
        return session

    def _keepalive(self, session: Session) -> None:
        """Let TCP find a vanished server within about a ttl while we wait on it."""
        sock = session._socket()  # noqa: SLF001 - our own class
        if sock.family == socket.AF_UNIX:
            return
        idle = max(1, int(self.ttl / 3))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)

    def _check(self, session: Session) -> None:
        """Refuse a Galera node: its user locks are local to the node (docs/design.md P20)."""
        row = session.row("SHOW VARIABLES LIKE 'wsrep\\_on'")
        if row is not None and str(row[1]).upper() == "ON":
            msg = (
                f"{self.settings.where} is a Galera cluster node (wsrep_on=ON): its GET_LOCK "
                "locks are local to that node, so lockrun cannot exclude across the cluster; "
                "point --uri at a server outside the cluster"
            )
            raise ConfigError(msg)
        self.checked = True

    def failure(self, err: pymysql.err.Error) -> LockrunError:
        """Translate a PyMySQL error into one line, naming the server but no password."""
        where = self.settings.where
        code = err.args[0] if err.args and isinstance(err.args[0], int) else 0
        text = _said(self.settings, err)
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

    # -- acquiring -----------------------------------------------------------------------

    def _passing(self, err: BaseException) -> bool:
        return _transient(err)

    def _key(self, request: Request) -> str:
        self._carries(request.namespace, request.name)
        return lock_key(request.namespace, request.name)

    def _carries(self, *texts: str | None) -> None:
        """Refuse a name the URI's charset cannot carry (78), before any statement.

        Names go into the holders table as they are; latin1, say, has no ``名``.
        """
        for text in texts:
            try:
                (text or "").encode(self.encoding)
            except UnicodeEncodeError:
                charset = self.settings.kwargs["charset"]
                msg = (
                    f"{self.settings.where}: charset {charset} cannot carry the name "
                    f"{text!r}; use charset=utf8mb4 (the default)"
                )
                raise ConfigError(msg) from None

    def _tag(self, request: Request, token: str) -> str:
        return _comment(request, token)

    def _session(self, attempt: Attempt[Session]) -> Session:  # noqa: ARG002 - all alike
        return self.session()

    def _revive(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Forget what an earlier acquisition left on a kept *session*; False if it ended."""
        session.unchecked = session.gate_left = None
        return bool(session.connection.open) and super()._revive(session, attempt)

    def _end(self, sessions: Sequence[Session]) -> None:
        """KILL *sessions* we hung up on, so their waits leave the queue now.

        The server notices a hang-up during GET_LOCK only about once a second; an
        interrupted waiter should leave nothing behind at all (best effort).
        """
        with contextlib.suppress(LockrunError, pymysql.err.Error):
            session = self.session()
            try:
                for gone in sessions:
                    with contextlib.suppress(pymysql.err.Error):
                        session.one("KILL %s", (gone.id,))
            finally:
                session.close()

    def _lock(
        self, session: Session, part: int | str, seconds: float | None, attempt: Attempt[Session]
    ) -> bool:
        """One GET_LOCK (never a negative timeout, docs/design.md P20).

        After `_refuse_mismatch`, the next one tries at once, with the check in the same
        round trip, and waits in the queue only if the lock is busy. A shared request
        enters beside other shared holders where it can (`_enter_shared`).
        """
        if _reading(attempt) and part == 0:
            return self._enter_shared(session, seconds, attempt)
        lock = f"{attempt.key}:{part}"
        if session.unchecked is attempt:
            session.unchecked = None
            try_now = _get_lock(lock, 0, "")
            got = self._checked(session, attempt, try_now, lambda got: lock if got == 1 else None)
            if got is None:  # KILL QUERY from outside
                raise self._cancelled(part)
            if got == 1 or seconds == 0:
                return bool(got == 1)
        return self._get(session, lock, seconds, attempt, part)

    def _get(
        self,
        session: Session,
        lock: str,
        seconds: float | None,
        attempt: Attempt[Session],
        part: int | str,
    ) -> bool:
        """Wait up to *seconds* (None: a year) in GET_LOCK for *lock*; True if ours."""
        limit = _FOREVER if seconds is None else seconds
        patience = None if seconds is None else seconds + self.timeout
        tag = attempt.tag if limit else ""  # for `status`, which never sees a try that cannot wait
        got = session.one(_get_lock(lock, limit, tag), timeout=patience)
        if got is None:  # KILL QUERY from outside, or an error
            raise self._cancelled(part)
        return bool(got == 1)

    def _wait_for(self, session: Session, lock: str, attempt: Attempt[Session], part: str) -> bool:
        """Wait in *lock*'s queue until it is ours (True) or the attempt's deadline passes."""
        deadline = attempt.deadline
        while True:
            remaining = None if deadline is None else max(0.0, deadline - now())
            attempt.queued = attempt.queued or remaining != 0
            if self._get(session, lock, remaining, attempt, part):
                return True
            if deadline is not None and now() >= deadline:
                return False

    def _first_free(self, session: Session, attempt: Attempt[Session]) -> int:
        statement = _first_free(attempt.key, attempt.slots)
        if session.unchecked is not attempt:
            return int(session.one(statement))
        session.unchecked = None
        slot = self._checked(session, attempt, statement, lambda slot: _slot(attempt.key, slot))
        return int(slot)

    def _refuse_mismatch(self, session: Session, attempt: Attempt[Session]) -> None:
        """Have *attempt*'s next try on *session* refuse a live holder of another N.

        The check goes in that try's round trip (`_checked`), before any wait in the queue;
        without the tables there is nothing to check. A shared request checked already,
        with its first try (`_enter_shared`).
        """
        session.gate_left = None
        checks = self.tables is not False and not _reading(attempt)
        session.unchecked = attempt if checks else None

    def _checked(
        self,
        session: Session,
        attempt: Attempt[Session],
        statement: str,
        caught: Callable[[Any], str | None],
    ) -> Any:  # noqa: ANN401 - the try's answer
        """Check for a live holder of another N, then run *statement*, a try that never waits.

        One round trip; return the try's answer. A holder of another N is refused (78), once
        the lock the try caught, if any (*caught* names it from the answer), is let go.
        Without the tables nobody recorded anything: the try runs alone. A user of N > 1
        also looks for shared holders, who use one slot, where their table is.
        """
        key = attempt.key
        statements: list[tuple[str, object]] = [
            (_MISMATCH, (key, attempt.slots)),
            (statement, None),
        ]
        if attempt.slots > 1:
            statements.append((_SHARED_MISMATCH, (key, key)))
        answers: list[Answer] = []
        try:
            session.batch(statements, answers)
        except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as err:
            if not _tableless(err) or len(answers) == 1:
                raise
            if not answers:
                return session.one(statement)  # _grant finds out about the tables and says so
        mismatch, answer, *shared = answers  # a shared holder's table may be missing
        answer = answer.rows[0][0]
        found = mismatch.rows or (shared[0].rows if shared else ())
        if found:
            lock = caught(answer)
            if lock is not None:
                session.one("SELECT RELEASE_LOCK(%s)", (lock,))
            slots, record = found[0]
            raise _mismatch(attempt.request, int(slots), str(record))
        return answer

    # -- the modes: --shared, --take-over, --hold-at-least (docs/design.md A7) ----------------

    def _begin(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Give a shared or take-over request its state; a taker asks for the stop first.

        The stop request is the GET_LOCK KEY:stop, held by the taker's first session while
        it waits, and a row naming the taker. Takers queue on it: the newest that got it
        makes an older one that is granted meanwhile give way (`_end_stop`).
        """
        request = attempt.request
        if not (request.shared or request.take_over):
            return True
        attempt.mode = _Mode()
        if not request.take_over:
            return True
        if request.shared:  # a shared taker that can join the readers stops nobody
            attempt.mode.tried = True
            if self._mark_reader(session, attempt, through=False):
                attempt.mode.entered = True
                return True
        key = attempt.key
        stop = f"{key}:{_STOP}"
        record = json.dumps(request.holder.to_dict())
        row = (key, request.namespace, request.name, record, stop)
        answers: list[Answer] = []
        try:
            session.batch(
                (("SELECT GET_LOCK(%s, 0)", (stop,)), (_STOP_MARK, row)),
                answers,
            )
        except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as err:
            if not answers or not _tableless(err):  # no row: the message says less
                raise
        got = answers[0].rows[0][0]
        if got is None:
            raise self._cancelled(_STOP)
        if got != 1:
            if not self._wait_for(session, stop, attempt, _STOP):
                return False
            with contextlib.suppress(pymysql.err.OperationalError, pymysql.err.ProgrammingError):
                session.one(_STOP_MARK, row)  # best effort, as above
        attempt.mode.stop = session
        return True

    def _keepable(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Whether *session* holds nothing: not a taker's stop request."""
        return attempt.mode is None or attempt.mode.stop is not session

    def _enter_shared(
        self, session: Session, seconds: float | None, attempt: Attempt[Session]
    ) -> bool:
        """Enter as a shared holder at once if no one holds or waits for the lock.

        Else queue in slot 0's queue as an exclusive request does; the grant then passes
        through slot 0 (`_grant_shared`). Consecutive shared requests at the head of the
        queue so all enter, and a later one never overtakes a queued exclusive one.
        """
        mode: _Mode = attempt.mode
        if not mode.tried:
            mode.tried = True
            if self._mark_reader(session, attempt, through=False):
                mode.entered = True
                return True
        if seconds == 0:
            return False
        return self._get(session, f"{attempt.key}:0", seconds, attempt, 0)

    def _mark_reader(self, session: Session, attempt: Attempt[Session], *, through: bool) -> bool:
        """Take this shared holder's lock and row; True if they count, else leave none.

        *through*: the session holds slot 0, and lets it go in the same round trip. Else
        the row counts only if, once it is written, nobody holds slot 0, asks for a
        take-over, or keeps a window: an exclusive holder reads the rows after it got slot
        0, so one of the two always sees the other (docs/design.md A7). One round trip,
        with the check for users of another N.
        """
        request = attempt.request
        key, mark = attempt.key, f"r:{attempt.token}"
        lock = f"{key}:{mark}"
        record = json.dumps(request.holder._replace(slot=0, since=time.time()).to_dict())
        statements: list[tuple[str, object]] = [
            (_MARK, (key, mark, request.namespace, request.name, record)),
            ("SELECT GET_LOCK(%s, 0)", (lock,)),
        ]
        if through:
            statements.append(("SELECT RELEASE_LOCK(%s)", (f"{key}:0",)))
        else:
            statements += [
                ("SELECT IS_USED_LOCK(%s), IS_USED_LOCK(%s)", (f"{key}:0", f"{key}:{_STOP}")),
                (_MARKS_OF, (key, key)),
                (_MISMATCH, (key, 1)),
            ]
        sent = now()
        try:
            answers = self._need_marks(session, statements, "--shared")
        except BaseException:
            self._unmark(session, key, mark)
            raise
        if answers[1].rows[0][0] != 1:  # another session holds our random name: not ours
            self._unmark(session, key, mark)
            if through:
                msg = f"{self.where}: the lock {lock} is held by another session"
                raise BackendUnavailable(msg)
            return False
        if through:
            return True
        slot0, stop = answers[2].rows[0]
        found = _found(answers[3].rows)
        if answers[4].rows:
            self._unmark(session, key, mark)
            slots, other = answers[4].rows[0]
            raise _mismatch(request, int(slots), str(other))
        if slot0 is None and stop is None and not found.window:
            attempt.sent = sent
            return True
        self._unmark(session, key, mark)
        return False

    def _unmark(self, session: Session, key: str, mark: str) -> None:
        """Take back a shared holder's row and lock (best effort on a session that failed)."""
        lock = f"{key}:{mark}"
        with contextlib.suppress(pymysql.err.OperationalError, pymysql.err.ProgrammingError):
            session.one(_UNMARK, (key, mark))
        session.one("SELECT RELEASE_LOCK(%s)", (lock,))

    def _need_marks(
        self, session: Session, statements: Sequence[tuple[str, object]], mode: str
    ) -> list[Answer]:
        """Run *statements*, which need lockrun's tables, making them on first use.

        A user who may not use them gets `ConfigError`: *mode* cannot work without them.
        Nothing before the failing statement has changed anything then: a mark is written
        first.
        """
        for making in (False, True):
            answers: list[Answer] = []
            try:
                session.batch(statements, answers)
            except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as err:
                code = err.args[0] if err.args else None
                if code == ER.NO_SUCH_TABLE and not making:
                    try:
                        for statement in _TABLES:
                            session.one(statement)
                    except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as denied:
                        if not _tableless(denied):
                            raise
                        raise self._no_marks(mode, denied) from denied
                    continue
                if _tableless(err):
                    raise self._no_marks(mode, err) from err
                raise
            return answers
        raise AssertionError  # pragma: no cover - the loop returns or raises

    def _no_marks(self, mode: str, err: pymysql.err.Error | None = None) -> ConfigError:
        said = "" if err is None else f" ({_said(self.settings, err)})"
        return ConfigError(
            f"{self.where}: {mode} needs lockrun's table {MARKS}, which this user cannot "
            f"create or use{said}; create the tables ahead "
            "(docs/backends.md) or grant SELECT, INSERT, UPDATE, DELETE on them"
        )

    def _look(self, session: Session, attempt: Attempt[Session]) -> _Found:
        """Read, after the slot is ours: a take-over asked, a window, shared holders."""
        key = attempt.key
        statements = (
            ("SELECT IS_USED_LOCK(%s)", (f"{key}:{_STOP}",)),
            (_MARKS_OF, (key, key)),
        )
        answers: list[Answer] = []
        try:
            session.batch(statements, answers)
        except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as err:
            if not answers or not _tableless(err):  # no marks: no window, no shared holder
                raise
            if attempt.request.hold:  # said before the run, not after: it could not be kept
                raise self._no_marks(_HOLD_OPTION, err) from err
        return _found(answers[1].rows if len(answers) > 1 else (), answers[0].rows[0][0])

    def _settle(
        self, session: Session, attempt: Attempt[Session], lock: str, found: _Found
    ) -> bool:
        """With *lock* (slot 0) ours, wait out what the grant *found*; False: busy.

        Each wait (`_step`) is followed by a new look; a taker then ends its stop request.
        """
        mode: _Mode | None = attempt.mode
        taker = mode is not None and mode.stop is not None
        while True:
            if found.swept:
                with contextlib.suppress(
                    pymysql.err.OperationalError, pymysql.err.ProgrammingError
                ):
                    session.one(_SWEEP, (attempt.key, attempt.key))
            waited = self._step(session, attempt, lock, found, taker=taker)
            if waited is None:
                break
            if not waited:
                return False
            attempt.proved = now()
            found = self._look(session, attempt)
        if mode is not None and mode.stop is not None:
            if mode.stop is session:
                attempt.proved = now()
            self._end_stop(mode, attempt.key)
        return True

    def _step(
        self, session: Session, attempt: Attempt[Session], lock: str, found: _Found, *, taker: bool
    ) -> bool | None:
        """Wait once for what *found* says: True once waited, False if busy, None if free.

        A take-over asked after this attempt: give way (`TakenOver`). A window: wait until
        it ends (a piece at a time), holding the slot, so that the queue behind keeps its
        order, unless the deadline comes first; a taker ends it instead. Shared holders,
        for an exclusive request or a taker: wait until each has left.
        """
        deadline = attempt.deadline
        if found.stop is not None and not taker:
            if deadline is not None and now() >= deadline:
                return False  # a try: busy, as if the taker had the lock already
            raise TakenOver(f"taken over by {self._who(session, attempt.key, found.stop)}")
        if found.window and taker:
            session.one(_END_WINDOW, (attempt.key,))  # a take-over ends a window
        elif found.window:
            if deadline is not None and now() + found.window > deadline:
                return False
            self._sleep(session, lock, min(found.window, self.ttl / 3), attempt)
        elif found.readers and (taker or not attempt.request.shared):
            for mark in found.readers:
                reader = f"{attempt.key}:{mark}"
                if deadline is not None and now() >= deadline:
                    return False  # a try, or rows that stay live: busy, never a loop
                if not self._wait_for(session, reader, attempt, mark):
                    return False
                session.one("SELECT RELEASE_LOCK(%s)", (reader,))
        else:
            return None
        return True

    def _sleep(
        self, session: Session, lock: str, seconds: float, attempt: Attempt[Session]
    ) -> None:
        """Sleep on the server, holding *lock*: a statement that runs is not idle.

        Named after *lock* with the waiter's comment, so `status` shows a waiter. A KILL
        QUERY ends it early: the caller looks again.
        """
        seconds = max(0.001, seconds)
        statement = f"SELECT SLEEP({seconds:.3f}) AS '{lock}' {attempt.tag}"
        try:
            session.one(statement, timeout=seconds + self.timeout)
        except pymysql.err.OperationalError as err:
            if err.args[0] not in _CANCELLED:
                raise

    def _end_stop(self, mode: _Mode, key: str) -> None:
        """End a taker's stop request; `TakenOver` if a later taker got it in the release."""
        stop = f"{key}:{_STOP}"
        session, mode.stop = mode.stop, None
        assert session is not None  # noqa: S101 - a taker's
        answers: list[Answer] = []
        session.batch(
            (("SELECT RELEASE_LOCK(%s)", (stop,)), ("SELECT IS_USED_LOCK(%s)", (stop,))), answers
        )
        newer = answers[1].rows[0][0]
        if newer is not None:  # the newest taker wins: this one never ran
            raise TakenOver(f"taken over by {self._who(session, key, newer)}")

    def _who(self, session: Session, key: str, connection: object) -> str:
        """Name the taker whose session *connection* holds the stop lock of *key*.

        From its row, else from its waiting statement's comment in the processlist (its
        own user's sessions are the ones a user sees there without PROCESS), else by the
        connection. A taker writes its row just after it got the lock: asked again a few
        times, a moment apart, before the connection has to do.
        """
        where = f"connection {connection}"
        for again in range(_WHO_TRIES):
            if again:
                time.sleep(_WHO_PAUSE)
            holder, seen = self._taker(session, key, connection)
            if holder is not None:
                return f"{holder.user}@{holder.host} pid {holder.pid}"
            where = seen or where
        return where

    def _taker(
        self, session: Session, key: str, connection: object
    ) -> tuple[Holder | None, str | None]:
        """Return the taker's record (row, else comment), and its session as the server says.

        Any error is no answer; each waits up to a ttl, as a check does, so that a slow
        server does not make us hang up on a slot we still hold.
        """
        with contextlib.suppress(pymysql.err.Error):
            row = session.row(_TAKER, (key, connection), timeout=self.ttl)
            if row is not None:
                with contextlib.suppress(ValueError):
                    return Holder.from_dict(read_json(str(row[0]))), None
        with contextlib.suppress(pymysql.err.Error):
            row = session.row(
                "SELECT USER, HOST, INFO FROM information_schema.PROCESSLIST WHERE ID = %s",
                (connection,),
                timeout=self.ttl,
            )
            if row is not None:
                match = _WAITING.fullmatch(str(row[2]))
                who = None if match is None else read_identity(match["json"])
                seen = f"{row[0]}@{row[1]} (connection {connection})"
                return (None if who is None else who.holder), seen
        return None, None

    def _ask(self, session: Session, slot: int, seconds: float, attempt: Attempt[Session]) -> None:
        session.send(_get_lock(f"{attempt.key}:{slot}", seconds, attempt.tag))

    def _answer(self, session: Session, slot: int) -> bool:
        got = session.receive()  # the socket is readable: the answer is on its way
        if got is None:
            raise self._cancelled(slot)
        return bool(got == 1)

    def _release_gate(self, session: Session, attempt: Attempt[Session]) -> None:
        if session.gate_left is attempt:  # the grant's round trip let it go, after the fence
            session.gate_left = None
            return
        session.one("SELECT RELEASE_LOCK(%s)", (f"{attempt.key}:{GATE}",))

    def _cancel(self, winner: Session, sessions: Sequence[Session]) -> None:
        """From *winner*, end the other sessions' waits, and any slot they got meanwhile.

        Helpers are KILLed. The first session keeps the gate until the grant is done, so
        only its query is: it then answers NULL (or 1, if it got slot 0 first; closing
        it after the grant frees that too).
        """
        first, *helpers = sessions
        for loser in helpers:
            if loser is not winner:
                with contextlib.suppress(pymysql.err.OperationalError, pymysql.err.InternalError):
                    winner.one("KILL %s", (loser.id,))  # unknown thread: gone already
                loser.abandon()
        if first is not winner:
            winner.one("KILL QUERY %s", (first.id,))
            try:
                first.receive()
            except pymysql.err.Error:  # not the NULL that MariaDB answers: end it all
                first.abandon()
                with contextlib.suppress(pymysql.err.Error):
                    winner.one("KILL %s", (first.id,))

    def _grant(
        self, session: Session, attempt: Attempt[Session], slot: int
    ) -> SessionLease[Session] | None:
        """Record the holder, draw a fence, and refuse a live user with another N.

        Checking after recording ourselves catches two users of different N who got in at
        the same moment: the later check of the two sees the other's record. The same
        round trip reads what the modes left (`_settle`): None if that makes the lock busy.
        """
        if attempt.request.shared:
            return self._grant_shared(session, attempt)
        fence, other, found, record = self._fence(session, attempt, slot)
        lock = f"{attempt.key}:{slot}"
        if other is not None:  # leave no row behind, and the slot free; the caller hangs up
            with contextlib.suppress(pymysql.err.Error):
                forget = ((_FORGET, (attempt.key, slot)), ("SELECT RELEASE_LOCK(%s)", (lock,)))
                session.batch(forget, [])
            raise _mismatch(attempt.request, int(other[0]), str(other[1]))
        if not self._settle(session, attempt, lock, found):
            session.one("SELECT RELEASE_LOCK(%s)", (lock,))
            return None
        return MySQLLease(self, session, lock, slot, fence, attempt, record)

    def _grant_shared(
        self, session: Session, attempt: Attempt[Session]
    ) -> SessionLease[Session] | None:
        """Hold the lock shared: entered by the try, or now through slot 0, which it holds."""
        mode: _Mode = attempt.mode
        key = attempt.key
        mark = f"r:{attempt.token}"
        if not mode.entered:
            slot0 = f"{key}:0"
            if not self._settle(session, attempt, slot0, self._look(session, attempt)):
                session.one("SELECT RELEASE_LOCK(%s)", (slot0,))
                return None
            attempt.proved = now()
            self._mark_reader(session, attempt, through=True)
        return MySQLLease(self, session, f"{key}:{mark}", 0, None, attempt, None, mark)

    def _fence(
        self, session: Session, attempt: Attempt[Session], slot: int
    ) -> tuple[int | None, Any, _Found, str]:
        """Record the holder, draw a fence, check for another N, look at the modes' marks.

        Return (fence, a live other's row, what the marks say, the holder's record). One
        round trip and one commit (docs/design.md A7): the record and the fence in one
        transaction, then the check, which sees every record committed before ours, and
        the reads of a take-over's stop lock and of lockrun_marks, which need no commit.
        The holder of the gate lets it go in the same round trip, after the commit
        (`_release_gate`). The fence is None where the tables are out of reach; the record
        and the check are left out too, and the marks are read (in a round trip of their
        own) only by an attempt that waited or has a mode.
        """
        request = attempt.request
        key = attempt.key
        record = json.dumps(request.holder._replace(slot=slot, since=time.time()).to_dict())
        if self.tables is False:
            plain = attempt.mode is None and not attempt.queued and not request.hold
            return None, None, _Found() if plain else self._look(session, attempt), record
        statements: list[tuple[str, object]] = [
            ("START TRANSACTION", None),
            (_RECORD, (key, slot, request.slots, request.namespace, request.name, record)),
            (_NEXT_FENCE, (key,)),
            ("COMMIT", None),
        ]
        gate = attempt.gate is session
        if gate:
            statements.append(("SELECT RELEASE_LOCK(%s)", (f"{key}:{GATE}",)))
        first = len(statements)  # the reads that follow the commit
        statements += [
            ("SELECT IS_USED_LOCK(%s)", (f"{key}:{_STOP}",)),
            (_MISMATCH, (key, request.slots)),
            (_SHARED_MISMATCH, (key, key)) if request.slots > 1 else (_MARKS_OF, (key, key)),
        ]
        try:
            answers = self._draw(session, statements, optional=2)
        except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as err:
            if err.args[0] not in _NO_TABLES:
                raise
            self.tables = False
            self.note(
                f"no fence: cannot use the tables {FENCES} and {HOLDERS} on "
                f"{self.settings.where} ({_said(self.settings, err)}); LOCKRUN_FENCE stays unset"
            )
            return None, None, self._look(session, attempt), record
        self.tables = True
        if gate:
            session.gate_left = attempt
        if request.hold and len(answers) < len(statements):  # the marks could not be read:
            raise self._no_marks(_HOLD_OPTION)  # no window could be kept: said before the run
        reads = [answer.rows for answer in answers[first:]] + [(), (), ()]
        stop = reads[0][0][0] if reads[0] else None
        other = reads[1][0] if reads[1] else None
        if request.slots > 1:
            other = other or (reads[2][0] if reads[2] else None)
            found = _Found(stop=stop)
        else:
            found = _found(reads[2], stop)
        return answers[2].last_id, other, found, record

    @staticmethod
    def _draw(
        session: Session, statements: Sequence[tuple[str, object]], optional: int
    ) -> list[Answer]:
        """Run the grant's *statements*; on first use, make the tables and run them again."""
        try:
            return _grant_answers(session, statements, optional)
        except pymysql.err.ProgrammingError as err:
            if err.args[0] != ER.NO_SUCH_TABLE:
                raise
        for statement in _TABLES:
            session.one(statement)
        return _grant_answers(session, statements, optional)

    # -- holding -------------------------------------------------------------------------

    def holds(self, lease: SessionLease[Session]) -> bool:
        """Whether the server still gives *lease*'s slot to its session.

        The same statement asks whether a taker holds the stop lock (``lease.taken``);
        who it is costs a second one, once per taker.
        """
        assert isinstance(lease, MySQLLease)  # noqa: S101 - ours
        row = lease.session.row(
            "SELECT IS_USED_LOCK(%s) = CONNECTION_ID(), IS_USED_LOCK(%s)",
            (lease.key, f"{lease.base}:{_STOP}"),
            timeout=self.ttl,
        )
        ours, stop = (None, None) if row is None else row
        if ours != 1 or stop is None:
            lease.taken, lease.taker = None, None
        elif stop != lease.taker:
            lease.taker = stop
            lease.taken = TakenOver(f"taken over by {self._who(lease.session, lease.base, stop)}")
        return bool(ours == 1)

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is KILL QUERY, max_statement_time or max_execution_time's."""
        return isinstance(err, pymysql.err.Error) and err.args[0] in _CANCELLED

    def said(self, err: Exception) -> str:
        """Return the server's or the driver's words for *err*, without a password."""
        assert isinstance(err, pymysql.err.Error)  # noqa: S101 - our `errors` are PyMySQL's
        return _said(self.settings, err)

    def give_back(self, lease: SessionLease[Session]) -> None:
        """RELEASE_LOCK: the next waiter gets the slot at once.

        The holder's row stays: it no longer counts once the slot is free, and the next
        holder replaces it without waiting for a DELETE of ours to commit. A shared
        holder's row goes, in the same round trip: each has a name of its own.
        """
        assert isinstance(lease, MySQLLease)  # noqa: S101 - ours
        if lease.mark is None:
            lease.session.one("SELECT RELEASE_LOCK(%s)", (lease.key,))
            return
        answers: list[Answer] = []
        statements = (
            (_UNMARK, (lease.base, lease.mark)),
            ("SELECT RELEASE_LOCK(%s)", (lease.key,)),
        )
        try:
            lease.session.batch(statements, answers)
        except (pymysql.err.OperationalError, pymysql.err.ProgrammingError) as err:
            if not _tableless(err):  # the table went away under us: the lock goes anyway
                raise
            lease.session.one("SELECT RELEASE_LOCK(%s)", (lease.key,))

    def hold_over(self, lease: SessionLease[Session], hold: float) -> None:
        """Leave a window on the server's clock in lockrun_marks, then RELEASE_LOCK.

        The row commits before the release, so whoever the release hands the slot to reads
        it (`_settle`). In one round trip; without the table (and no right to make it),
        `ConfigError` once the slot is free: the hold cannot be kept.
        """
        assert isinstance(lease, MySQLLease)  # noqa: S101 - ours
        request = lease.request
        if lease.mark is not None or request.slots != 1:
            self.give_back(lease)
            msg = "--hold-at-least applies to an exclusive lock of one slot"
            raise ConfigError(msg)
        record = lease.record or json.dumps(request.holder.to_dict())
        micros = min(_MAX_HOLD_US, max(1, round(hold * 1_000_000)))
        window = (lease.base, micros, request.namespace, request.name, record)
        statements = ((_WINDOW, window), ("SELECT RELEASE_LOCK(%s)", (lease.key,)))
        try:
            self._need_marks(lease.session, statements, "--hold-at-least")
        except ConfigError:
            lease.session.one("SELECT RELEASE_LOCK(%s)", (lease.key,))
            raise

    # -- status --------------------------------------------------------------------------

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        self._carries(namespace, name)
        session = self.session()
        try:
            waiters = _waiters(session)
            if name is None:
                names = set(self._recorded(session, namespace))
                names |= {waiter.name for waiter in waiters if waiter.namespace == namespace}
                states = [self._state(session, namespace, each, waiters) for each in sorted(names)]
                return [state for state in states if state.holders or state.waiters]
            return [self._state(session, namespace, name, waiters)]
        except pymysql.err.Error as err:
            raise self.failure(err) from err
        finally:
            session.close()

    def _recorded(self, session: Session, namespace: str) -> list[str]:
        """Return the names lockrun's tables have holders or windows of (none without them)."""
        names: list[str] = []
        for statement in (
            (
                f"SELECT DISTINCT name FROM {HOLDERS} WHERE namespace = %s "
                "AND IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id"
            ),
            (  # the names of rows that may count; `_state` reads each lock's own
                f"SELECT DISTINCT name FROM {MARKS} WHERE namespace = %s "
                f"AND (mark = '{_HOLD}' AND until_us > {_NOW_US} OR mark LIKE 'r:%%') LIMIT 1000"
            ),
        ):
            with contextlib.suppress(pymysql.err.ProgrammingError, pymysql.err.OperationalError):
                names += [str(row[0]) for row in session.rows(statement, (namespace,))]
        return names

    def _state(
        self, session: Session, namespace: str, name: str, waiters: list[_Waiter]
    ) -> LockState:
        """Read one lock: who holds which slot (IS_USED_LOCK, our records), who waits."""
        key = lock_key(namespace, name)
        queue = [waiter for waiter in waiters if waiter.lock.startswith(f"{key}:")]
        records: dict[int, tuple[int, int, str]] = {}  # slot → (N, connection, holder JSON)
        with contextlib.suppress(pymysql.err.ProgrammingError, pymysql.err.OperationalError):
            for slot, slots, connection, holder in session.rows(
                f"SELECT slot, slots, connection_id, holder FROM {HOLDERS} WHERE lock_key = %s",
                (key,),
            ):
                records[int(slot)] = (int(slots), int(connection), str(holder))
        known = {slots for slots, _, _ in records.values()} | {waiter.slots for waiter in queue}
        known = {slots for slots in known if 1 <= slots <= MAX_SLOTS}  # the table is anyone's
        marked = self._marked(session, key)
        if marked:
            known.add(1)  # a window, shared holders: a lock of one slot
        probed = max(known, default=_PROBED_SLOTS)
        used = session.row(
            "SELECT " + ", ".join(f"IS_USED_LOCK('{key}:{slot}')" for slot in range(probed))
        )
        # A session that holds slot 0 while it waits (for shared holders to leave, or a
        # window to end) is a waiter: it is in the queue's statements.
        waiting = {waiter.connection for waiter in queue}
        holders = [
            self._holder(session, slot, int(connection), records.get(slot))
            for slot, connection in enumerate(used)
            if connection is not None and int(connection) not in waiting
        ]
        holders += marked
        # The head waits on the slots (one line per slot), the others on the gate.
        queue.sort(key=lambda waiter: waiter.lock.endswith(":gate"))
        people = {waiter.token: waiter.holder for waiter in queue}  # dicts keep the order
        return LockState(
            namespace, name, key, max(known, default=None), tuple(holders), tuple(people.values())
        )

    @staticmethod
    def _marked(session: Session, key: str) -> list[Holder]:
        """Return the holders that rows of lockrun_marks add: a window's run, shared holders.

        Anyone who may write the table may forge a row: a window is cut to the longest a
        hold can be (`_MARKS_OF`), a record that is none is shown as its session.
        """
        try:
            rows = session.rows(_MARKS_OF, (key, key))
        except (pymysql.err.ProgrammingError, pymysql.err.OperationalError):
            return []
        holders = []
        for mark, connection, left, live, record, server_now in rows:
            if mark == _HOLD:
                window = _micros(left)
                if not window or not isinstance(server_now, int):
                    continue
                until = server_now / 1_000_000 + window
                holders.append(_recorded_holder(record, connection)._replace(slot=0, until=until))
            elif live == 1 and isinstance(mark, str) and _READER.fullmatch(mark):
                holder = _recorded_holder(record, connection)
                holders.append(holder._replace(slot=0, shared=True, until=None))
        return holders

    @staticmethod
    def _holder(
        session: Session, slot: int, connection: int, record: tuple[int, int, str] | None
    ) -> Holder:
        """Describe the session *connection* that holds *slot*, from our record if it is its."""
        if record is not None and record[1] == connection:
            with contextlib.suppress(ValueError):  # anyone who may write the table may forge
                return Holder.from_dict(read_json(record[2]))._replace(slot=slot)
        row = session.row(
            "SELECT USER, HOST FROM information_schema.PROCESSLIST WHERE ID = %s", (connection,)
        )
        user, host = ("?", "?") if row is None else (str(row[0]), str(row[1]))
        return Holder(f"{host} (connection {connection})", 0, user, (), slot=slot)


class MySQLLease(SessionLease[Session]):
    """A slot (or a shared hold) of a session, with what a hold window or a take-over needs."""

    def __init__(
        self,
        backend: MySQLBackend,
        session: Session,
        key: str,
        slot: int,
        fence: int | None,
        attempt: Attempt[Session],
        record: str | None,
        mark: str | None = None,
    ) -> None:
        """Describe *key* (slot *slot*, or the shared holder *mark*) held for *attempt*."""
        super().__init__(backend, session, key, slot, fence)
        self.base: str = attempt.key  # the lock's key without its part: KEY:stop is beside
        self.request = attempt.request
        self.record = record  # the holder's JSON, which a hold window keeps for `status`
        self.mark = mark  # a shared holder's row in lockrun_marks
        self.taker: object = None  # the session whose take-over `taken` names


class _Mode:
    """What a shared or take-over attempt registered and found (`Attempt.mode`)."""

    def __init__(self) -> None:
        self.stop: Session | None = None  # a taker's session holding KEY:stop
        self.tried = False  # whether a shared request tried to enter (with its check of N)
        self.entered = False  # whether that try entered: the lease needs no statement


class _Found(NamedTuple):
    """What a grant read of the modes: a take-over, a window, shared holders."""

    stop: object = None  # the session holding KEY:stop, if any
    window: float = 0.0  # seconds of a hold window left
    readers: tuple[str, ...] = ()  # the marks of live shared holders
    swept: bool = False  # whether rows of shared holders that ended are left to sweep


def _found(rows: Sequence[Any], stop: object = None) -> _Found:
    """Read `_MARKS_OF`'s rows, which anyone who may write the table could have forged."""
    window, readers, swept = 0.0, [], False
    for row in rows:
        if not isinstance(row, tuple) or len(row) < 4:  # noqa: PLR2004 - the statement's columns
            continue
        mark, _, left, live = row[:4]
        if mark == _HOLD:
            window = max(window, _micros(left))
        elif isinstance(mark, str) and mark.startswith("r:"):
            if live == 1 and _READER.fullmatch(mark):
                readers.append(mark)
            else:
                swept = True
    return _Found(stop, window, tuple(readers), swept)


def _micros(value: object) -> float:
    """Return µs read back as seconds, 0 unless a number in [0, `_MAX_HOLD_US`]."""
    if isinstance(value, bool) or not isinstance(value, int | float | decimal.Decimal):
        return 0.0
    seconds = float(value) / 1_000_000
    return seconds if 0 <= seconds <= _MAX_HOLD_US / 1_000_000 else 0.0


def _reading(attempt: Attempt[Session]) -> bool:
    """Whether *attempt* enters as a shared holder beside others (a shared taker does not)."""
    return attempt.request.shared and (attempt.mode is None or attempt.mode.stop is None)


def _recorded_holder(record: object, connection: object) -> Holder:
    """Return the holder a mark's record names; a record that is none names the session."""
    try:
        return Holder.from_dict(read_json(record if isinstance(record, str) else ""))
    except ValueError:  # anyone who may write the table may forge
        return Holder(f"? (connection {connection})", 0, "?", ())


def _said(settings: Settings, err: pymysql.err.Error) -> str:
    """Return what PyMySQL or the server said of *err*, in one line, with no secret."""
    text = str(err.args[1]) if len(err.args) > 1 else str(err) or type(err).__name__
    return scrub(" ".join(text.split()), settings.secrets)


def _grant_answers(
    session: Session, statements: Sequence[tuple[str, object]], optional: int
) -> list[Answer]:
    """Run the grant's *statements* in one round trip and return the answers.

    Fewer if one of the last *optional* (reads of the records and marks) may not read its
    table: as without the tables, there is nothing to find. Any other error is raised
    after a rollback, so that the session, which may serve more acquisitions, is never
    left in a transaction.
    """
    answers: list[Answer] = []
    try:
        session.batch(statements, answers)
    except pymysql.err.Error as err:
        if len(answers) >= len(statements) - optional and _tableless(err):
            return answers
        with contextlib.suppress(pymysql.err.Error):  # best effort: the session may be gone
            session.one("ROLLBACK")
        raise
    return answers


def _tableless(err: pymysql.err.Error) -> bool:
    """Whether *err* says lockrun's tables are missing or out of reach."""
    code = err.args[0] if err.args else None
    return code in _NO_TABLES or code == ER.NO_SUCH_TABLE


def _transient(err: BaseException | None) -> bool:
    """Whether *err* is a lost connection that a waiter may ride out (not a refusal)."""
    if isinstance(err, BackendUnavailable):
        return "cancelled on the server" in str(err) or _transient(err.__cause__)
    return isinstance(err, pymysql.err.OperationalError) and err.args[0] in _LOST


class _Waiter(NamedTuple):
    """A lockrun waiter as its GET_LOCK's comment describes it in the processlist."""

    connection: int
    lock: str
    token: str
    namespace: str
    name: str
    slots: int
    holder: Holder


def _waiters(session: Session) -> list[_Waiter]:
    """Return every lockrun waiter the processlist shows, longest waiting first."""
    waited = "TIME_MS" if session.mariadb else "TIME"  # MySQL knows whole seconds only
    rows = session.rows(
        f"SELECT ID, {waited}, INFO FROM information_schema.PROCESSLIST "
        "WHERE ID <> CONNECTION_ID() AND (INFO LIKE 'SELECT GET\\_LOCK(''lr:%' "
        "OR INFO LIKE 'SELECT SLEEP(%')"
    )
    waiters = []
    for connection, _, info in sorted(rows, key=lambda row: (-float(row[1] or 0), int(row[0]))):
        match = _WAITING.fullmatch(str(info))
        who = None if match is None else read_identity(match["json"])  # "*\\/" is JSON's "*/"
        if match is not None and who is not None:  # else not ours after all, or forged badly
            waiters.append(_Waiter(int(connection), f"{match['key']}:{match['part']}", *who))
    return waiters


def _comment(request: Request, token: str) -> str:
    """Return the comment a waiter's GET_LOCK carries: who waits, for `lockrun status`."""
    identity = {
        "token": token,
        "namespace": request.namespace,
        "name": request.name,
        "slots": request.slots,
        "holder": request.holder.to_dict(),
    }
    return "/* lockrun " + json.dumps(identity).replace("*/", "*\\/") + " */"


def _get_lock(lock: str, seconds: float, tag: str) -> str:
    # Only hex digits, a colon and "gate" ever reach the quotes.
    return f"SELECT GET_LOCK('{lock}', {seconds:.3f}) {tag}"


def _slot(key: str, slot: int) -> str | None:
    """Return the GET_LOCK name of *slot* of *key*; None for -1, no slot."""
    return None if slot < 0 else f"{key}:{slot}"


def _first_free(key: str, slots: int) -> str:
    """Return a statement that takes the first free slot (CASE stops at the first) or -1."""
    tries = " ".join(f"WHEN GET_LOCK('{key}:{slot}', 0) = 1 THEN {slot}" for slot in range(slots))
    return f"SELECT CASE {tries} ELSE -1 END"


def _mismatch(request: Request, slots: int, record: str) -> ConfigError:
    try:
        holder = Holder.from_dict(read_json(record))
    except ValueError:  # a row another client of the server wrote: said without it
        holder = None
    return slots_mismatch(request, slots, holder)
