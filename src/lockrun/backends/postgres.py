"""PostgreSQL: session advisory locks as a first-in first-out semaphore (psycopg 3).

docs/design.md A6 and A8 give the reasons behind this design.

Keys are signed 64-bit: the first 8 bytes, big-endian, of SHA-256(namespace NUL name NUL
part), where part is ``0`` … ``N-1`` for the slots and ``gate`` for the queue of a
semaphore (never ``hashtext``: 32 bits collide). pg_locks shows key k as ``classid = k >> 32``
and ``objid = k & 0xffffffff`` (both unsigned), ``objsubid = 1``.

The semaphore is `lockrun.backends.sessionlock`'s, on pg_advisory_lock: the server grants in
arrival order, and one ``lock_timeout`` bounds a wait (asking again would put us at the back
of the queue; ``--wait forever`` sets none). The head of a semaphore's queue terminates its
losing helper sessions with pg_terminate_backend.

A slot lives with its session: the server frees it when the connection ends, or once the
session idled for its ``idle_session_timeout``, which is the lease. The holder proves
ownership in pg_locks every ttl/3 and never reconnects (no pools, docs/design.md P19). Every holder
also takes the shared int-pair lock (hash32(namespace NUL name), N), which tells users of
another N apart. Statements carry a ``/* lockrun {json} */`` comment naming who runs them,
which `lockrun status` reads back from pg_stat_activity.

The modes: --shared takes the slot's key in ShareLock mode (one queue with the writers);
--hold-at-least leaves a row in the table ``lockrun_holds``, made on first use, that
every one-slot grant reads; --take-over holds the name's ``stop`` key while it waits and
NOTIFYs the holders, which LISTEN from their grant (docs/design.md A8).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import select
import socket
import time
from typing import TYPE_CHECKING, Final, NamedTuple

import psycopg
from psycopg import pq

from lockrun.backends import (
    MAX_RECORD,
    Holder,
    Identity,
    LockState,
    Request,
    read_identity,
    readable_file,
    slots_mismatch,
    timeout_for,
)
from lockrun.backends.sessionlock import GATE, Attempt, SessionLease, SessionLockBackend
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.errors import BackendUnavailable, ConfigError, LockrunError, TakenOver
from lockrun.timing import DEFAULT_TTL, now
from lockrun.uri import Secrets, scrub, secrets_of

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from collections.abc import Set as AbstractSet

    from lockrun.uri import LockURI

_MAX_LOCK_TIMEOUT: Final = 2_147_483_647  # ms: the largest lock_timeout; 0 would mean none
_PROBED_SLOTS: Final = 64  # `status` looks at this many slots when it cannot learn N
_V13: Final = 130000  # pg_current_xact_id()
_V14: Final = 140000  # idle_session_timeout, client_connection_check_interval, waitstart
_V17: Final = 170000  # transaction_timeout
_CANCEL_AGAIN: Final = 0.05  # s: a cancel that got no answer by then may have been dropped
_REFRESH_GONE: Final = 1.0  # s: a refresh cut off by a release ends within this
_LONGEST_POLL: Final = 86400.0  # s: a poll(2) longer than this is made of several
_CHECK_CLIENT: Final = "1s"  # how often a waiting server session looks for its client (14+)
_TAG_BYTES: Final = 900  # pg_stat_activity keeps 1024 bytes of a statement by default
STOP: Final = "stop"  # the part of a name whose key a taker holds while it waits
# SQLSTATEs
_LOCK_NOT_AVAILABLE: Final = "55P03"  # lock_timeout
_QUERY_CANCELED: Final = "57014"
_NOT_ALLOWED: Final = frozenset({"42501", "42883"})  # insufficient privilege, no such function
# A session ended under us: server shut down or restarted, backend terminated, idle too long.
_ENDED: Final = frozenset({"57P01", "57P02", "57P03", "57P05"})
# libpq's words for a refusal → what lockrun says (libpq gives no SQLSTATE for these)
_FAILURES: Final[tuple[tuple[str, type[LockrunError], str], ...]] = (
    (
        r"authentication failed|no password supplied",
        BackendUnavailable,
        "{where}: authentication failed: {text}",
    ),
    (r'database ".*" does not exist', ConfigError, "{where}: no such database: {text}"),
    (r"invalid [\w ]*value", ConfigError, "{where}: {text}"),  # ?sslmode=bogus, ?port=x
    (
        r"too many clients|connection slots are reserved",
        BackendUnavailable,
        "{where}: the server has no free connection (max_connections): {text}",
    ),
    (
        r"ssl negotiation|expected authentication request|invalid length of startup packet",
        BackendUnavailable,
        "{where} does not answer like a PostgreSQL server",
    ),
)
# libpq parameters that name a file libpq opens and reads: a FIFO there would block it.
_FILE_PARAMETERS: Final = frozenset({"passfile", "sslcert", "sslkey", "sslrootcert", "sslcrl"})
# Statements every session prepares: planning a join with pg_stat_activity takes longer
# than running it. EXECUTE takes our own values, formatted ints.
# --hold-at-least: the window of a run that ended, as (lock key, end on the server's clock,
# the run's identity as JSON), created on first use (docs/design.md A8).
WINDOWS: Final = "lockrun_holds"
_PREPARED: Final = {
    # In one scan of pg_locks: the holders of (name, N) locks with N other than $2 (kind 2),
    # and the sessions holding the stop key (classid $3, objid $4; kind 1), with whether
    # each waits for an advisory lock (docs/design.md A8). Activity is read per row found:
    # pg_stat_get_activity of one pid, not the whole view.
    "lockrun_others": "PREPARE lockrun_others(bigint, int, oid, oid) AS "
    "SELECT l.objsubid, l.objid, l.pid, a.query, pg_get_userbyid(a.usesysid), "
    "host(a.client_addr), l.objsubid = 1 AND EXISTS (SELECT FROM pg_locks w "
    "WHERE w.pid = l.pid AND NOT w.granted AND w.locktype = 'advisory') "
    "FROM pg_locks l LEFT JOIN LATERAL pg_stat_get_activity(l.pid) a ON true "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND ((l.objsubid = 2 AND l.classid = ($1 & 4294967295)::oid AND l.objid <> $2::oid) "
    "OR (l.objsubid = 1 AND l.classid = $3 AND l.objid = $4 AND l.pid <> pg_backend_pid())) "
    "ORDER BY l.pid",
    # Whether this session holds the advisory lock (classid $1, objid $2), in either mode
    # (a row whose first column is true), and the stop key's holders as above: one scan.
    "lockrun_check": "PREPARE lockrun_check(oid, oid, oid, oid) AS "
    "SELECT l.pid = pg_backend_pid(), l.pid, a.query, pg_get_userbyid(a.usesysid), "
    "host(a.client_addr), l.pid <> pg_backend_pid() AND EXISTS (SELECT FROM pg_locks w "
    "WHERE w.pid = l.pid AND NOT w.granted AND w.locktype = 'advisory') "
    "FROM pg_locks l LEFT JOIN LATERAL (SELECT * FROM pg_stat_get_activity(l.pid) "
    "WHERE l.pid <> pg_backend_pid()) a ON true "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
    "AND ((l.pid = pg_backend_pid() AND l.classid = $1 AND l.objid = $2) "
    "OR (l.pid <> pg_backend_pid() AND l.classid = $3 AND l.objid = $4 AND l.database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database()))) ORDER BY l.pid",
    # Whether the table of --hold-at-least windows exists, under the statement's snapshot
    # (a name the catalog cache remembers as missing may be older than our transaction).
    "lockrun_table": "PREPARE lockrun_table AS SELECT EXISTS (SELECT FROM pg_class c "
    f"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relname = '{WINDOWS}' "
    "AND n.nspname = ANY (current_schemas(false)))",
}
_CREATE_WINDOWS: Final = (
    (
        f"CREATE TABLE IF NOT EXISTS {WINDOWS} "
        "(key bigint PRIMARY KEY, until timestamptz NOT NULL, holder text NOT NULL)"
    ),
    # Users of a name may log in as different roles: each must see and write its windows.
    # Writing one is no more power than holding the lock, which any role may do.
    f"GRANT SELECT, INSERT, UPDATE, DELETE ON {WINDOWS} TO PUBLIC",
)
_GIVE_BACK: Final = (
    "SELECT pg_advisory_unlock_all(), set_config('application_name', 'lockrun', false)"
)
_UNLISTEN: Final = "UNLISTEN *"
# The open window of slot $1: seconds left, cut to MAX_WAIT (anyone may write the table).
_WINDOW: Final = (
    f"SELECT extract(epoch FROM least(until, clock_timestamp() + interval "
    f"'{int(MAX_WAIT)} seconds') - clock_timestamp()) FROM {WINDOWS} "
    "WHERE key = $1 AND until > clock_timestamp() ORDER BY until DESC LIMIT 1"
)
_PREPARED_READ: Final = "prepared"  # Session.windowed: lockrun_window is
_BROKEN: Final = "inline"  # Session.windowed: a read failed; the next ones are not prepared
_WINDOWS_SHOWN: Final = 10000  # `status` reads at most this many open windows
_MAX_STAMP: Final = 2.0**40  # a Unix time past the year 36812 is made up (Holder's bound)
_NO_ANSWER: Final = "the server sent no answer"
_GRANT_ANSWERS: Final = 2  # a grant's statements: the grant, the others (N, takers)
_UNDEFINED_TABLE: Final = "42P01"
_DUPLICATE: Final = "23505"  # two sessions creating the table at once
_TAGGED: Final = re.compile(r"/\* lockrun (?P<json>\{.*\}) \*/", re.DOTALL)


def lock_key(namespace: str, name: str, part: str | int) -> int:
    r"""Return the advisory-lock key of a slot (*part* 0 … N-1) or of ``"gate"``.

    In SQL: ``('x' || left(encode(sha256(convert_to(namespace, 'UTF8') || '\x00'::bytea
    || convert_to(name, 'UTF8') || '\x00'::bytea || convert_to(part, 'UTF8')), 'hex'),
    16))::bit(64)::bigint``.
    """
    digest = hashlib.sha256(f"{namespace}\0{name}\0{part}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def slots_key(namespace: str, name: str) -> int:
    """Return the int4 half of the shared lock (key, N) that every holder of the name takes."""
    digest = hashlib.sha256(f"{namespace}\0{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


def _halves(key: int) -> tuple[int, int]:
    """Return pg_locks' (classid, objid) of a bigint key."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


class Settings(NamedTuple):
    """Where the server is, from a postgresql: or postgres: URI, which libpq reads as it is."""

    where: str  # the URI without its password, for messages
    conninfo: str
    secrets: Secrets  # what libpq's and the server's words must never show


def parse(uri: LockURI) -> Settings:
    """Check *uri* with libpq's own parser; raise `ConfigError` for a bad one.

    libpq ends the user information at its first ``@`` where RFC 3986 (and lockrun) take
    the last: any other ``@`` of it goes to libpq as ``%40``, so both read the same host.
    """
    conninfo = uri.text
    if uri.userinfo is not None and "@" in uri.userinfo:
        start = conninfo.index("//") + 2
        conninfo = (
            conninfo[:start]
            + uri.userinfo.replace("@", "%40")
            + "@"
            + uri.hosts
            + (conninfo[start + len(uri.netloc) :])
        )
    settings = Settings(uri.redacted, conninfo, secrets_of(uri.text, conninfo))
    try:
        parameters = psycopg.conninfo.conninfo_to_dict(conninfo)
    except (psycopg.Error, UnicodeError) as err:  # %-escapes that are not UTF-8, too
        reason = _one_line(settings, str(err))
        msg = f"{uri.redacted}: not a libpq connection URI: {reason}"
        raise ConfigError(msg) from None
    for parameter in sorted(_FILE_PARAMETERS & parameters.keys()):
        path = str(parameters[parameter])
        if os.path.exists(path) and not readable_file(path):  # missing: libpq's to say
            msg = f"{uri.redacted}: {parameter} {path}: not a regular file we may read"
            raise ConfigError(msg)
    return settings


def _one_line(settings: Settings, text: str) -> str:
    """Squeeze a libpq message into one line with no secret, nor a piece of one, in it."""
    text = " ".join(text.split()).removeprefix("connection failed: ")
    return scrub(text.replace(settings.conninfo, settings.where), settings.secrets)


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


class PgError(Exception):
    """A statement failed; *sqlstate* is None when the connection itself failed."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        """Keep the server's one-line *message* and its SQLSTATE."""
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate
        # The rows of the statements of a `send_simple` that ran before the one that failed.
        self.answers: list[list[tuple[str | None, ...]]] = []


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

    def fileno(self) -> int:
        """Return the socket's descriptor; `PgError` once libpq has closed it."""
        try:
            return self.pgconn.socket
        except psycopg.OperationalError as err:  # the connection is lost
            raise PgError(_first_line(str(err))) from err

    def send(self, sql: str, *params: object) -> None:
        """Send *sql* ($1, $2 … for *params*, as text) without waiting for the answer."""
        try:
            values = [None if value is None else str(value).encode() for value in params]
            # The tag first: pg_stat_activity keeps only the first 1024 bytes.
            self.pgconn.send_query_params(f"{self.tag} {sql}".encode(), values or None)
            while self.pgconn.flush():  # rarely: a statement larger than the socket takes
                if not _ready(self.fileno(), 5.0, select.POLLOUT):
                    msg = "the server takes no more of our statement"
                    raise NoAnswer(msg)
        except psycopg.OperationalError as err:
            raise PgError(_first_line(str(err))) from err

    def send_simple(self, *statements: str) -> None:
        """Send *statements* in one message, run in order in one transaction (values inline).

        One round trip where each would take its own; `answers` reads their rows.
        """
        try:
            self.pgconn.send_query(f"{self.tag} {'; '.join(statements)}".encode())
            while self.pgconn.flush():
                if not _ready(self.fileno(), 5.0, select.POLLOUT):
                    msg = "the server takes no more of our statement"
                    raise NoAnswer(msg)
        except psycopg.OperationalError as err:
            raise PgError(_first_line(str(err))) from err

    def literal(self, text: str) -> str:
        """Return *text* quoted as a SQL string literal, as libpq escapes it for the server."""
        try:
            return bytes(pq.Escaping(self.pgconn).escape_literal(text.encode())).decode()
        except psycopg.OperationalError as err:
            raise PgError(_first_line(str(err))) from err

    def ready(self) -> bool:
        """Read what arrived; return whether the whole answer is in (never blocks)."""
        try:
            self.pgconn.consume_input()
        except psycopg.OperationalError as err:
            raise PgError(_first_line(str(err))) from err
        return not self.pgconn.is_busy()

    def receive(self, timeout: float | None) -> list[tuple[str | None, ...]]:
        """Wait up to *timeout* seconds (None: as long as it takes) for the rows of `send`."""
        answers = self.answers(timeout)
        return answers[-1] if answers else []

    def answers(self, timeout: float | None) -> list[list[tuple[str | None, ...]]]:
        """Wait as `receive` does; return the rows of each statement of `send_simple`."""
        deadline = None if timeout is None else now() + timeout
        answers: list[list[tuple[str | None, ...]]] = []
        error: PgError | None = None
        while True:
            while self.pgconn.is_busy():  # get_result would block: wait for more, in time
                left = None if deadline is None else deadline - now()
                if (left is not None and left <= 0) or not _ready(self.fileno(), left):
                    raise NoAnswer(f"no answer within {timeout:g}s")
                self.ready()
            result = self.pgconn.get_result()
            if result is None:
                break
            if result.status == pq.ExecStatus.FATAL_ERROR and (error is None or not error.sqlstate):
                state = result.error_field(pq.DiagnosticField.SQLSTATE)
                text = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
                message = _first_line(text or result.error_message or b"the statement failed")
                error = PgError(message, state.decode(errors="replace") if state else None)
            elif result.status == pq.ExecStatus.TUPLES_OK:
                answers.append(
                    [
                        tuple(_text(result.get_value(row, col)) for col in range(result.nfields))
                        for row in range(result.ntuples)
                    ]
                )
        if error is not None:
            error.answers = answers
            raise error
        if self.pgconn.status != pq.ConnStatus.OK:
            raise PgError(_first_line(self.pgconn.get_error_message() or "the connection ended"))
        return answers

    def rows(
        self, sql: str, *params: object, timeout: float | None
    ) -> list[tuple[str | None, ...]]:
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


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode(errors="replace")


def _first_line(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return " ".join(text.split()).removeprefix("ERROR: ").removeprefix("FATAL: ")


class _Keys:
    """The keys of one name: its slots, its gate, its stop key, the shared (name, N) lock."""

    def __init__(self, namespace: str, name: str, slots: int) -> None:
        self.slots = [lock_key(namespace, name, slot) for slot in range(slots)]
        self.gate = lock_key(namespace, name, GATE)
        self.stop = lock_key(namespace, name, STOP)
        self.agreed = slots_key(namespace, name)


class _Ahead(NamedTuple):
    """What a grant's round trip learnt: its fence, and the rows of `lockrun_others`."""

    fence: int | None
    others: list[tuple[str | None, ...]]


class _Window(NamedTuple):
    """A --hold-at-least window found on a slot just taken: seconds left, by the server."""

    remaining: float


class _Outlasted(Exception):
    """A window outlasts the waiter's deadline; the slot was given back (`_take` says busy)."""


class _Lease(SessionLease[Session]):
    """A slot of a PostgreSQL session: what a take-over check and a window need to know."""

    def __init__(
        self,
        backend: PostgresBackend,
        session: Session,
        keys: _Keys,
        slot: int,
        attempt: Attempt[Session],
    ) -> None:
        super().__init__(backend, session, keys.slots[slot], slot, None)
        self.keys = keys
        self.token = attempt.token
        self.names = (attempt.request.namespace, attempt.request.name)
        self.request = attempt.request
        self.holder = attempt.request.holder  # as the grant named it: a window's row keeps it
        self.hold = 0.0  # --hold-at-least: seconds the slot stays taken after release
        self.refused: ConfigError | None = None  # a window that could not be written

    def release(self, hold: float = 0.0) -> bool:
        """Give the slot back, leaving a window of *hold* seconds if that is asked.

        A window that could not be written is a `ConfigError` (78), raised once the slot
        is free: the slot is never left held for want of a table.
        """
        if not self.released:
            self.hold = hold
        heard = super().release(hold)
        bells, self.bells = self.bells, ()
        for bell in bells:
            os.close(bell)
        refused, self.refused = self.refused, None
        if refused is not None:
            raise refused
        return heard


class PostgresBackend(SessionLockBackend[Session]):
    """Sessions on one PostgreSQL server (or a pooler in session mode)."""

    errors = (PgError,)
    waits = "pg_advisory_lock"

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        warn: Callable[[str], None],
        note: Callable[[str], None],
    ) -> None:
        """Remember *settings*; *warn* and *note* get one-line remarks (stderr, -v)."""
        super().__init__()
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.warn = warn
        self.note = note
        self.timeout = timeout_for(ttl, durable=True)
        self.connect_timeout = max(2, math.ceil(self.timeout))  # libpq's least is 2 s
        self.version = 0  # server_version_num, once a session told it
        self.checked = False  # whether the server was found usable (a primary, no pooler)
        self.durable = True  # whether fences can be made durable (pg_logical_emit_message)
        # Whether the table of --hold-at-least windows exists (then every one-slot grant
        # reads it), and whether we said it cannot be read.
        self.windows = False
        self.unreadable = False

    # -- sessions ------------------------------------------------------------------------

    def session(self, tag: str = "/* lockrun */", label: str = "lockrun") -> Session:
        """Open a session whose locks the server frees after it idled for a lease.

        *label* is its application_name; a holder's becomes ``lockrun:NAME:SLOT``.
        """
        idle = max(1, int(self.ttl / 3))
        session = self._connect(
            tag,
            application_name=label,
            client_encoding="UTF8",
            # TCP keepalive finds a vanished server while we wait on it (TCP only).
            keepalives=1,
            keepalives_idle=idle,
            keepalives_interval=max(1, idle // 3),
            keepalives_count=3,
        )
        try:
            self._setup(session, session.connection.info.server_version)
            if session.connection.info.backend_pid != session.pid and not self.checked:
                self._check_pooler(session)
            self.checked = True
        except PgError as err:
            session.abandon()
            raise self.failure(err) from err
        except BaseException:
            session.abandon()
            raise
        return session

    def _connect(self, tag: str = "/* lockrun */", **options: str | int) -> Session:
        """Connect with libpq *options* beside the URI's; nothing else."""
        try:
            conninfo = psycopg.conninfo.make_conninfo(
                self.settings.conninfo, connect_timeout=self.connect_timeout, **options
            )
            connection = psycopg.Connection.connect(conninfo, autocommit=True)
        except psycopg.Error as err:
            raise self.failure(err) from err
        return Session(connection, tag)

    def _setup(self, session: Session, version: int) -> None:
        """Set the lease and the waits' limits on *session*, learn its pid, refuse a standby.

        No statement timeout may cut a long wait short; a stalled holder keeps its locks
        only as long as its lease (idle_session_timeout, PostgreSQL 14+).
        """
        lease = f"{max(1, math.ceil(self.ttl * 1000))}ms"
        settings = [
            ("statement_timeout", "0"),
            ("lock_timeout", "0"),
            ("idle_in_transaction_session_timeout", "0"),
            # The server's keepalive may end a silent session only after a whole lease:
            # the supervisor counts on the lock living that long after the last check.
            ("tcp_keepalives_idle", str(max(1, math.ceil(self.ttl)))),
            ("tcp_keepalives_interval", str(max(1, math.ceil(self.ttl / 10)))),
            ("tcp_keepalives_count", "3"),
            ("synchronous_commit", "local"),  # the fence's commit waits for the disk
        ]
        if version >= _V17:
            settings += [("transaction_timeout", "0")]  # it ends a session mid-wait
        if version >= _V14:
            settings += [
                ("idle_session_timeout", lease),
                ("client_connection_check_interval", _CHECK_CLIENT),
            ]
        elif not self.version:
            self.warn(
                f"{self.settings.where}: PostgreSQL {version // 10000} has no "
                "idle_session_timeout (14+), so a stalled holder keeps its lock until its "
                "connection breaks"
            )
        self.version = version
        calls = ", ".join(f"set_config('{name}', '{value}', false)" for name, value in settings)
        # The grant's and the renewals' statements are planned once per session, not per
        # use; a pooler may hand us a server session that another client prepared them on.
        session.send_simple(
            f"SELECT pg_backend_pid(), pg_is_in_recovery(), "
            f"to_regclass('{WINDOWS}') IS NOT NULL, {calls}",
            "DEALLOCATE ALL",
            *_PREPARED.values(),
        )
        row = session.answers(self.timeout)[0][0]
        session.pid = int(row[0] or 0)
        self.windows = self.windows or row[2] == "t"
        if row[1] == "t":
            msg = (
                f"{self.settings.where} is a standby (in recovery): its advisory locks are "
                "its own; point --uri at the primary (target_session_attrs=read-write)"
            )
            raise BackendUnavailable(msg)

    def _check_pooler(self, session: Session) -> None:
        """Refuse a pooler that shares server sessions between clients (docs/design.md P22).

        Something between us and the server answered with its own process id. In session
        pooling our server session is ours alone; in transaction pooling the session we
        just used goes back to the pool after each statement. A busy pool can still hide
        that; the holder's checks then find its lock on another session and stop the
        command (76).
        """
        other = self._connect()  # as a second client would
        try:
            # Twice in a row on ours: a pooler that hands out the longest idle server
            # session (round robin) moves us; then the other client: one that hands out
            # the latest (PgBouncer's default) gives it ours.
            again = session.one("SELECT pg_backend_pid()", timeout=self.timeout)
            theirs = other.one("SELECT pg_backend_pid()", timeout=self.timeout)
        except PgError:  # statement pooling refuses more, or we were cut off
            shared = True
        else:
            shared = again != str(session.pid) or theirs == str(session.pid)
        finally:
            other.close()
        if shared:
            msg = (
                f"{self.settings.where} is a connection pooler in transaction or statement "
                "mode (PgBouncer?): session advisory locks do not survive it; connect to "
                "PostgreSQL directly or through session pooling"
            )
            raise ConfigError(msg)
        self.note(f"{self.settings.where}: a pooler in session mode; its sessions hold locks")

    def failure(self, err: psycopg.Error | PgError) -> LockrunError:
        """Translate a failure into one line, naming the server but no password."""
        where = self.settings.where
        text = _one_line(self.settings, getattr(err, "message", None) or str(err))
        if isinstance(err, psycopg.ProgrammingError):  # libpq refused the URI
            return ConfigError(f"{where}: not a libpq connection URI: {text}")
        if isinstance(err, psycopg.errors.ConnectionTimeout):
            return BackendUnavailable(f"{where}: no answer within {self.connect_timeout}s")
        if isinstance(err, NoAnswer):
            return BackendUnavailable(f"{where}: {text}")
        for pattern, kind, what in _FAILURES:
            if re.search(pattern, text, re.IGNORECASE):
                return kind(what.format(where=where, text=text))
        return BackendUnavailable(f"{where}: {text}")

    # -- acquiring -----------------------------------------------------------------------

    def _passing(self, err: BaseException) -> bool:
        return _transient(err)

    def _key(self, request: Request) -> _Keys:
        return _Keys(request.namespace, request.name, request.slots)

    def _tag(self, request: Request, token: str) -> str:
        return _comment(request, token, request.holder)

    def _session(self, attempt: Attempt[Session]) -> Session:
        return self.session(attempt.tag, _application_name(attempt.request.name, "waiting"))

    def _revive(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Check a kept session, and have it carry *attempt*'s comment from now on.

        A kept session may still listen where a try of its asked (`_draw`): a NOTIFY read
        there is no goodbye. Anything else is, or libpq finds the connection gone.
        """
        session.tag = attempt.tag
        try:
            session.ready()
        except PgError:
            return False
        session.heard()
        return session.pgconn.status == pq.ConnStatus.OK and super()._revive(session, attempt)

    def _end(self, sessions: Sequence[Session]) -> None:
        """Terminate server sessions we hung up on, so their waits leave the queue now.

        A waiting server session notices a hang-up only at its next client check (a
        second on 14+, else when granted); an interrupted waiter should leave nothing.
        """
        pids = [session.pid for session in sessions if session.pid]
        if not pids:
            return
        with contextlib.suppress(LockrunError, PgError):
            session = self.session()
            try:
                session.rows(
                    "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid",
                    "{" + ",".join(map(str, pids)) + "}",
                    timeout=self.timeout,
                )
            finally:
                session.close()

    def _take(self, attempt: Attempt[Session]) -> tuple[int, Session | None]:
        """As any session lock; a window that outlasts the deadline ends the wait, busy."""
        try:
            return super()._take(attempt)
        except _Outlasted:
            return -1, None

    def _lock(
        self, session: Session, part: int | str, seconds: float | None, attempt: Attempt[Session]
    ) -> bool:
        """One pg_advisory_lock bounded by lock_timeout (none for ever), or one try.

        A taker holds the name's stop key while it waits (committed before the wait, so
        holders see it); a one-slot wait that got the slot looks for a --hold-at-least
        window in the same round trip (docs/design.md A8).
        """
        key = attempt.key.gate if part == GATE else attempt.key.slots[part]
        if attempt.request.hold and not self.windows:
            self._make_windows(session, attempt.request.name)
        if seconds == 0 and attempt.slots == 1:
            return self._try_and_grant(session, attempt)
        if seconds == 0:
            got = session.one("SELECT pg_try_advisory_lock($1::bigint)", key, timeout=self.timeout)
            return got == "t"
        answers, error = self._queue(session, key, part, seconds, attempt)
        if not answers:  # the wait itself failed
            if error is not None and error.sqlstate == _LOCK_NOT_AVAILABLE:
                # The deadline, or a wait longer than lock_timeout can say (asked again).
                if attempt.deadline is not None and now() >= attempt.deadline:
                    self._unstop(session, attempt)
                return False
            if error is not None and error.sqlstate == _QUERY_CANCELED:
                raise self._cancelled(part) from error
            raise error or PgError(_NO_ANSWER)
        if attempt.slots == 1:
            window = self._window(session, key, answers[1:], error)
            if window is not None:
                self._sit_out(session, attempt, window)
        return True

    def _make_windows(self, session: Session, name: str) -> None:
        """Make the table of windows before a --hold-at-least run; 78 now if this role cannot.

        Once per backend, where the table is missing: a window the release could not write
        would be a fleet's job run on every host, said only after it ran.
        """
        session.send_simple(*_CREATE_WINDOWS)
        _, error = self._results(session, self.timeout)
        if error is not None and error.sqlstate != _DUPLICATE:  # a race with another maker
            msg = (
                f"{name}: --hold-at-least needs table {WINDOWS} on {self.where}, which this "
                f"role cannot make ({_one_line(self.settings, error.message)}); "
                "docs/backends.md (PostgreSQL) says how to make it ahead"
            )
            raise ConfigError(msg)
        self.windows = True

    def _queue(
        self,
        session: Session,
        key: int,
        part: int | str,
        seconds: float | None,
        attempt: Attempt[Session],
    ) -> tuple[list[list[tuple[str | None, ...]]], PgError | None]:
        """Wait for *key* up to *seconds*: `_results` of the wait and the window check after.

        A taker takes the stop key first, in a transaction of its own, whose commit sends
        the holders its NOTIFY while it waits; a one-slot wait then reads the window.
        """
        statements = [_wait_for(seconds, key, shared=attempt.request.shared and part != GATE)]
        asking = attempt.request.take_over and not session.stopping
        if asking:  # try: a stop key held exclusively (by no lockrun) must not block us
            stop = (
                f"SELECT pg_try_advisory_lock_shared({attempt.key.stop}::bigint), "
                f"pg_notify('{_channel(attempt.key)}', '')"  # rings the holders' bells
            )
            statements[:0] = [stop, "COMMIT"]
            session.stopping = True
        if attempt.slots == 1:  # a statement of its own: its snapshot is taken after the wait
            statements += self._window_check(session, key)
        session.send_simple(*statements)
        answers, error = self._results(session, None if seconds is None else seconds + self.timeout)
        if asking and answers:
            session.stopping = answers.pop(0)[:1] == [("t", "")]
            if not session.stopping:
                self.note(
                    f"{self.where}: the stop key of {attempt.request.name} is held "
                    "exclusively by another session: this wait asks no holder to stop"
                )
        return answers, error

    def _results(
        self, session: Session, timeout: float | None
    ) -> tuple[list[list[tuple[str | None, ...]]], PgError | None]:
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

    def _unstop(self, session: Session, attempt: Attempt[Session]) -> None:
        """Let a taker's stop key go: it gave up its wait, and a kept session asks nothing."""
        if session.stopping:
            session.rows(
                f"SELECT pg_advisory_unlock_shared({attempt.key.stop}::bigint)",
                timeout=self.timeout,
            )
            session.stopping = False

    # -- --hold-at-least windows ---------------------------------------------------------

    def _window_check(self, session: Session, key: int) -> list[str]:
        """Return the statements that read the window of slot *key*, if the table exists.

        Where this backend has not seen the table, they ask whether the table exists now
        (made since our sessions began): `_window` then reads it in a round trip of its own.
        They ask pg_class under the statement's snapshot: a cached "no such table" could be
        older than the unlock that let us in. The read is prepared on its session's first
        use (planning it costs more than running it); it cannot be before the table exists.
        """
        if not self.windows:
            return ["EXECUTE lockrun_table"]
        if session.windowed == _BROKEN:  # a failed read: whether it is prepared is unknown
            return [_WINDOW.replace("$1", str(key))]
        prepare = [] if session.windowed else [f"PREPARE lockrun_window(bigint) AS {_WINDOW}"]
        session.windowed = _PREPARED_READ
        return [*prepare, f"EXECUTE lockrun_window({key})"]

    def _window(
        self,
        session: Session,
        key: int,
        answers: list[list[tuple[str | None, ...]]],
        error: PgError | None,
    ) -> _Window | None:
        """Read `_window_check`'s answer for a slot we hold; None if no window is open."""
        if error is not None or not answers:
            self._unreadable(session, error)
            return None
        rows = answers[0]
        if not self.windows:
            if rows != [("t",)]:
                return None
            self.windows = True
            session.send_simple(*self._window_check(session, key))
            answers, error = self._results(session, self.timeout)
            if error is not None or not answers:
                self._unreadable(session, error)
                return None
            rows = answers[0]
        return _parse_window(rows)

    def _unreadable(self, session: Session, error: PgError | None) -> None:
        """Say once that windows cannot be read (another role's table, or not lockrun's)."""
        session.windowed = _BROKEN  # a prepared statement outlives the failed transaction
        if error is not None and error.sqlstate == _UNDEFINED_TABLE:
            self.windows = False  # dropped: none to respect
            return
        if not self.unreadable:
            self.unreadable = True
            said = "no answer" if error is None else _one_line(self.settings, error.message)
            self.warn(
                f"{self.where}: table {WINDOWS} cannot be read ({said}), so this run does "
                "not see --hold-at-least windows; docs/backends.md says how it is made"
            )

    def _sit_out(self, session: Session, attempt: Attempt[Session], window: _Window) -> None:
        """Wait out *window* on the slot just taken, keeping it (and so our place in line).

        A deadline that comes first is busy at once: the slot is given back to the next in
        line (`_Outlasted`). Otherwise the session sleeps on the server: a running statement
        is no idle session, so its lease (idle_session_timeout) does not end it, and a
        lockrun that dies meanwhile is noticed by client_connection_check_interval.
        """
        deadline = attempt.deadline
        if deadline is not None and now() + window.remaining > deadline:
            self._give_back(session)
            raise _Outlasted
        session.tag = attempt.tag  # a waiter's, for status, until the grant names the holder
        waiting = session.literal(_application_name(attempt.request.name, "waiting"))
        session.rows(
            f"SELECT set_config('application_name', {waiting}, false), "
            f"pg_sleep({window.remaining:.6f})",
            timeout=window.remaining + self.timeout,
        )

    def _first_free(self, session: Session, attempt: Attempt[Session]) -> int:
        return int(session.one(_first_free(attempt.key), timeout=self.timeout) or -1)

    def _ask(self, session: Session, slot: int, seconds: float, attempt: Attempt[Session]) -> None:
        session.send_simple(_wait_for(seconds, attempt.key.slots[slot]))

    def _answer(self, session: Session, slot: int) -> bool | None:
        if not session.ready():
            return None
        try:
            # The result is in, but libpq is busy until ReadyForQuery follows it, which
            # may come in a later packet: it is on its way, wait for it (it was 69).
            session.receive(self.timeout)
        except PgError as err:
            if err.sqlstate == _LOCK_NOT_AVAILABLE:
                return False
            if err.sqlstate == _QUERY_CANCELED:
                raise self._cancelled(slot) from err
            raise
        return True

    def _release_gate(self, session: Session, attempt: Attempt[Session]) -> None:
        session.rows(
            "SELECT pg_advisory_unlock($1::bigint)", attempt.key.gate, timeout=self.timeout
        )

    def _cancel(self, winner: Session, sessions: Sequence[Session]) -> None:
        """From *winner*, end the other sessions' waits, and any slot they got meanwhile.

        Helpers are terminated. The first session keeps the gate until the grant is done,
        so only its statement is cancelled: it then fails, or holds slot 0 too, which
        closing it after the grant frees.
        """
        first, *helpers = sessions
        losers = [helper for helper in helpers if helper is not winner]
        if losers:
            winner.rows(
                "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid",
                "{" + ",".join(str(loser.pid) for loser in losers) + "}",
                timeout=self.timeout,
            )
            for loser in losers:
                loser.abandon()
        if first is not winner:
            self._cancel_first(winner, first)

    def _cancel_first(self, winner: Session, first: Session) -> None:
        """Cancel the first session's wait on slot 0 until it answers.

        A cancel that reaches the server between two statements is dropped, and the first
        session may just have sent its next piece of the wait: so ask again until it ends.
        """
        deadline = now() + self.ttl / 3 + self.timeout  # a piece ends by itself by then
        while True:
            winner.rows("SELECT pg_cancel_backend($1)", first.pid, timeout=self.timeout)
            try:
                first.receive(_CANCEL_AGAIN)
            except NoAnswer:
                if now() > deadline:
                    raise
                continue
            except PgError as err:
                if err.sqlstate not in {_QUERY_CANCELED, _LOCK_NOT_AVAILABLE}:
                    raise
            return

    def _try_and_grant(self, session: Session, attempt: Attempt[Session]) -> bool:
        """Try a one-slot lock; if it was free, draw the fence in the same statement.

        One round trip either way, with the check of N after it: the grant's check if the
        try got the lock, else the one before queueing (`_refuse_mismatch` reads it). A
        slot taken under a --hold-at-least window is waited out (`_sit_out`), and then
        granted afresh.
        """
        self._name(session, attempt, 0)
        attempt.sent = now()
        got, ahead, window = self._draw(session, attempt, 0, trying=True)
        attempt.ahead = ahead
        if not got:  # nothing was granted: a waiter's statements name a waiter
            attempt.sent = None
            session.tag = attempt.tag
            return False
        if window is not None:
            self._judge(ahead.others, attempt)  # another N is said before busy
            self._sit_out(session, attempt, window)
            attempt.sent = attempt.ahead = None  # `_grant` draws the fence from now
        return True

    def _grant_steps(self, session: Session, attempt: Attempt[Session], slot: int) -> list[str]:
        """Return the grant's expressions: the fence, the name, the shared (name, N) lock.

        A shared holder has no fence (a fence orders writers): NULL in its place. A taker
        lets its stop key go: granted, it asks nobody to stop any more.
        """
        request = attempt.request
        current = "pg_current_xact_id()::text::bigint" if self.version >= _V13 else "txid_current()"
        name = session.literal(_application_name(request.name, slot))
        steps = [
            "NULL" if request.shared else current,
            f"set_config('application_name', {name}, false)",
            f"pg_try_advisory_lock_shared({attempt.key.agreed}::int, {request.slots}::int)",
        ]
        if session.stopping:
            steps.append(f"pg_advisory_unlock_shared({attempt.key.stop}::bigint)")
        if self.durable and not request.shared:
            steps.append("pg_logical_emit_message(true, 'lockrun', '') IS NOT NULL")
        return steps

    def _durable_refused(self, err: PgError) -> bool:
        """Whether *err* refused the logical message that makes fences durable: note it."""
        if not self.durable or err.sqlstate not in _NOT_ALLOWED:
            return False
        self.durable = False  # not allowed here (a managed service, say)
        self.note(
            f"{self.settings.where}: fences are transaction ids that a server crash may "
            f"repeat: pg_logical_emit_message is not allowed "
            f"({_one_line(self.settings, err.message)})"
        )
        return True

    def _grant(self, session: Session, attempt: Attempt[Session], slot: int) -> _Lease:
        """Draw a fence, name the session, take the shared (name, N) lock, check N.

        One round trip (`_draw`), unless the try that got the slot drew it already. A
        take-over asked by someone who waits behind us is obeyed at once: the slot goes
        back and `TakenOver` is raised (docs/semantics.md "Take-over").
        """
        lease = _Lease(self, session, attempt.key, slot, attempt)
        try:
            if attempt.sent is None:
                self._name(session, attempt, slot)
                _, ahead, _ = self._draw(session, attempt, slot, trying=False)
            else:  # the try drew it (`_try_and_grant`)
                ahead = attempt.ahead
            lease.holder = session.holder or lease.holder
            lease.fence = ahead.fence
            self._judge(ahead.others, attempt)
            _give_way([row[2:] for row in ahead.others if row[0] == "1"], lease)
        except BaseException:
            lease.release()
            raise
        # The session's socket, turned readable by a taker's NOTIFY: a copy, as the
        # supervisor watches the socket itself for a hang-up (docs/design.md A8).
        lease.bells = (os.dup(session.fileno()),)
        return lease

    def _name(self, session: Session, attempt: Attempt[Session], slot: int) -> None:
        """Have *session*'s statements name it the holder of *slot*, from now."""
        request = attempt.request
        session.holder = request.holder._replace(
            slot=slot, since=time.time(), shared=request.shared
        )
        session.tag = _comment(request, attempt.token, session.holder)

    def _draw(
        self, session: Session, attempt: Attempt[Session], slot: int, *, trying: bool
    ) -> tuple[bool, _Ahead, _Window | None]:
        """Try *slot* (or, not *trying*, count it as held); if ours, draw a fence: one trip.

        Return whether the slot is ours, what the grant learnt (`_Ahead`): the fence, the
        live users of another N, read after the shared (name, N) lock was taken (checking
        after taking it catches two users of different N who got in at the same moment, as
        the later check of the two sees the other's lock), and the takers waiting; and, for
        a try that got the slot, its --hold-at-least window, read in a transaction of its
        own that begins after the try (a window committed before the unlock that freed the
        slot is seen).

        The fence is the id of a transaction of ours, made durable. Transaction ids only
        grow, cluster-wide. A transaction that wrote nothing commits without waiting for
        its record to reach disk, so a crash could hand its id out again; a logical message
        (prefix ``lockrun``) is the smallest write that makes the commit wait for the disk.
        """
        request = attempt.request
        key = attempt.key.slots[slot]
        lock = "pg_try_advisory_lock_shared" if request.shared else "pg_try_advisory_lock"
        taking = f"{lock}({key}::bigint)" if trying else "true"
        steps = ", ".join(
            f"CASE WHEN got THEN {step} END" for step in self._grant_steps(session, attempt, slot)
        )
        statements = [
            f"SELECT got, {steps} FROM (SELECT {taking} AS got OFFSET 0) AS try",
            _others(attempt.key, request.slots),
        ]
        channel = _channel(attempt.key)
        if session.listening != channel:  # from the commit on, a taker's NOTIFY rings our bell
            statements += [_UNLISTEN] if session.listening else []
            statements.append(f"LISTEN {channel}")
        if trying:  # in the same transaction, but with a snapshot taken after the try
            statements += self._window_check(session, key)
        session.send_simple(*statements)
        answers, error = self._results(session, self.timeout)
        if len(answers) < _GRANT_ANSWERS:  # the grant failed, not the window's read
            if error is None or not self._durable_refused(error):
                raise error or PgError(_NO_ANSWER)
            return self._draw(session, attempt, slot, trying=trying)  # a held slot: again
        session.listening = channel if error is None else ""
        ([got, fence, *_],), others = answers[:_GRANT_ANSWERS]
        if got != "t":
            return False, _Ahead(None, others), None
        if error is not None:  # the window's read failed, and rolled the grant back with it
            self._unreadable(session, error)
            _, ahead, _ = self._draw(session, attempt, slot, trying=False)  # ours: again
            return True, ahead, None
        session.stopping = False  # the grant let go of a taker's stop key
        ahead = _Ahead(None if request.shared else int(fence or 0), others)
        window = self._window(session, key, answers[_GRANT_ANSWERS:], None) if trying else None
        return True, ahead, window

    def _refuse_mismatch(self, session: Session, attempt: Attempt[Session]) -> None:
        """Raise `ConfigError` if a live holder of the name uses another N.

        A one-slot try ran the check already, in its round trip (`_try_and_grant`).
        """
        if attempt.ahead is not None:
            others = attempt.ahead.others
            attempt.ahead = None
        else:
            session.send_simple(_others(attempt.key, attempt.slots))
            others = session.receive(self.timeout)
        self._judge(others, attempt)

    @staticmethod
    def _judge(rows: list[tuple[str | None, ...]], attempt: Attempt[Session]) -> None:
        """Raise `ConfigError` if *rows* of `lockrun_others` name a live user of the name."""
        request = attempt.request
        for row in rows:
            if row[0] != "2":  # a stop key's holder
                continue
            slots, who = int(row[1] or 0), _tagged(row[3] or "")
            if not 1 <= slots <= MAX_SLOTS:  # no lockrun takes (key, N) with such an N
                continue
            if who is None:  # another role's session: trust the 32-bit key
                raise slots_mismatch(request, slots)
            if (who.namespace, who.name) == (request.namespace, request.name):
                raise slots_mismatch(request, slots, who.holder)

    # -- holding -------------------------------------------------------------------------

    def holds(self, lease: SessionLease[Session]) -> bool:
        """Whether pg_locks still shows *lease*'s slot granted to its session.

        The same round trip looks for takers (`TakenOver`, the slot still ours): sessions
        that hold the name's stop key and wait (docs/design.md A8).
        """
        if not isinstance(lease, _Lease):  # every lease of ours is one
            raise TypeError(lease)
        classid, objid = _halves(lease.key)
        stop_class, stop_obj = _halves(lease.keys.stop)
        session = lease.session
        heard = session.heard()  # what rang the bell: this check answers it
        for _ in range(2):
            session.send_simple(
                f"EXECUTE lockrun_check({classid}, {objid}, {stop_class}, {stop_obj})"
            )
            rows = session.receive(self.ttl)
            if not any(row[0] == "t" for row in rows):
                return False
            _give_way([row[1:] for row in rows if row[0] != "t"], lease, heard)
            # A NOTIFY read with the answer may have come after the check ran: ask again.
            heard = session.heard()
            if not heard:
                break
        return True

    def was_cancelled(self, err: Exception) -> bool:
        """Whether *err* is pg_cancel_backend's or a statement timeout's (57014)."""
        return isinstance(err, PgError) and err.sqlstate == _QUERY_CANCELED

    def said(self, err: Exception) -> str:
        """Return the server's or libpq's words for *err*, in one line, without a password."""
        return _one_line(self.settings, err.message if isinstance(err, PgError) else str(err))

    def give_back(self, lease: SessionLease[Session]) -> None:
        """Unlock everything the session holds: the next waiter has it when this returns.

        With a --hold-at-least window to leave, its row is written and committed first, in
        the same round trip: whoever the unlock lets in reads it (`_window`). A window that
        cannot be written is refused (`_Lease.release` raises 78), the slot freed all the
        same. Its application_name no longer names a slot: the session may be kept, idle.
        """
        if isinstance(lease, _Lease) and lease.hold > 0:
            try:
                self._leave_window(lease)
            except PgError as err:
                if isinstance(err, NoAnswer) or err.sqlstate is None:
                    raise
                name = lease.names[1]
                lease.refused = ConfigError(
                    f"{name}: --hold-at-least needs table {WINDOWS} on {self.where}, which "
                    f"this role cannot write ({_one_line(self.settings, err.message)}); "
                    "the lock was released at once (docs/backends.md, PostgreSQL)"
                )
            else:
                return
        self._give_back(lease.session)

    def hold_over(self, lease: SessionLease[Session], hold: float) -> None:  # noqa: ARG002
        """Leave the window `give_back` writes for a lease whose ``hold`` is set (`_Lease`)."""
        self.give_back(lease)

    def _give_back(self, session: Session) -> None:
        """Unlock all that *session* holds (slot, gate, stop key); it then hears nothing."""
        session.send_simple(*([_UNLISTEN] if session.listening else []), _GIVE_BACK)
        session.answers(self.timeout)
        session.stopping, session.listening = False, ""
        session.heard()

    def _leave_window(self, lease: _Lease, again: bool = True) -> None:
        """Write *lease*'s window (now + hold, by the server's clock), commit, unlock: one trip.

        The table is made on first use. Rows of windows that ended go in the same
        transaction, so the table holds about one row per window open.
        """
        session = lease.session
        # The whole record (its command line cut at about 1 kB), not the comment's part.
        record = _identity(lease.request, lease.token, lease.holder, room=MAX_RECORD // 2)
        statements = [] if self.windows else list(_CREATE_WINDOWS)
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
            _UNLISTEN,
            _GIVE_BACK,
        ]
        session.send_simple(*statements)
        try:
            session.answers(self.timeout)
        except PgError as err:
            if again and err.sqlstate == _DUPLICATE and not self.windows:
                self._leave_window(lease, again=False)  # made by another session meanwhile
                return
            raise
        self.windows = True
        session.stopping, session.listening = False, ""
        session.heard()

    def cut(self, lease: SessionLease[Session]) -> bool:
        """Cut the connection under a hanging refresh; wait for that thread to leave libpq."""
        lease.session.hang_up()
        # Until the refresh thread is out of libpq's connection, leave the connection be.
        return lease.busy.acquire(timeout=_REFRESH_GONE)

    # -- status --------------------------------------------------------------------------

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        session = self.session()
        try:
            windows = self._windows(session)
            if name is not None:
                return [self._state(session, namespace, name, windows)]
            rows = session.rows(
                "SELECT query FROM pg_stat_activity WHERE query LIKE '%/* lockrun {%' "
                "AND pid <> pg_backend_pid()",
                timeout=self.timeout,
            )
            tagged = [_tagged(row[0] or "") for row in rows]
            tagged += [who for who, _ in windows.values()]
            names = {who.name for who in tagged if who is not None and who.namespace == namespace}
            states = [self._state(session, namespace, each, windows) for each in sorted(names)]
            return [state for state in states if state.holders or state.waiters]
        except PgError as err:
            raise self.failure(err) from err
        finally:
            session.close()

    def _windows(self, session: Session) -> dict[int, tuple[Identity | None, float]]:
        """Read every open --hold-at-least window: key → (the run, as its row says; its end).

        Anyone may write the table: a row is read as untrusted, its end cut to `MAX_WAIT`
        from now, and a table that cannot be read shows no window (status never fails).
        """
        if not self.windows:
            return {}
        session.send_simple(
            f"SELECT key::text, extract(epoch FROM least(until, clock_timestamp() + "
            f"interval '{int(MAX_WAIT)} seconds')), left(holder::text, {MAX_RECORD}) "
            f"FROM {WINDOWS} WHERE until > clock_timestamp() LIMIT {_WINDOWS_SHOWN}"
        )
        answers, error = self._results(session, self.timeout)
        return _open_windows(answers[0] if error is None and answers else [])

    def _state(
        self,
        session: Session,
        namespace: str,
        name: str,
        windows: dict[int, tuple[Identity | None, float]],
    ) -> LockState:
        """Read one lock from pg_locks and pg_stat_activity: who holds which slot, who waits.

        A run's --hold-at-least window is a holder with `until`; a session that waits one
        out holds slot 0 meanwhile and is shown as the first waiter. Shared holders and
        waiters are told by pg_locks' mode, not by their comments.
        """
        keys = _Keys(namespace, name, _PROBED_SLOTS)
        parts = {key: slot for slot, key in enumerate(keys.slots)} | {keys.gate: -1}
        waited = "extract(epoch FROM l.waitstart)" if self.version >= _V14 else "NULL"
        rows = session.rows(
            "SELECT l.objsubid, (l.classid::bigint << 32) | l.objid::bigint, l.objid, "
            f"l.granted, l.pid, {waited}, a.usename, host(a.client_addr), "
            "extract(epoch FROM a.backend_start), a.query, l.mode, a.application_name "
            "FROM pg_locks l "
            "LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND ((l.objsubid = 1 "
            "AND (l.classid::bigint << 32) | l.objid::bigint = ANY($1::bigint[])) "
            "OR (l.objsubid = 2 AND l.classid = ($2::bigint & 4294967295)::oid)) "
            "ORDER BY 6, l.pid",
            "{" + ",".join(map(str, parts)) + "}",
            keys.agreed,
            timeout=self.timeout,
        )
        window = windows.get(keys.slots[0])
        sitting = _application_name(name, "waiting")  # the name of a session that waits
        known: set[int] = set()
        holders: list[Holder] = []
        head: dict[str, Holder] = {}  # the gate's holder, waiting on the slots
        queue: dict[str, Holder] = {}  # waiting on the gate or on slot 0 (N = 1)
        for row in rows:
            subid, key, objid, granted, pid, _, user, client, started, query, mode, label = row
            who = _tagged(query or "")
            if who is not None:
                known.add(who.slots)
            if subid == "2":
                if 1 <= int(objid or 0) <= MAX_SLOTS:  # any role may take such a lock
                    known.add(int(objid or 0))
                continue
            slot = parts[int(key or 0)]
            person = who.holder if who is not None else _stranger(pid, user, client, started)
            person = person._replace(shared=mode == "ShareLock", until=None)
            token = who.token if who is not None else str(pid)
            if granted == "t" and slot == 0 and window is not None and label == sitting:
                head = {token: person} | head  # waits out the window, first in line
            elif granted == "t" and slot >= 0:
                holders.append(person._replace(slot=slot))
            elif granted != "t" and (slot < 0 or who is None or who.slots == 1):
                queue.setdefault(token, person)
            elif granted != "t":
                head.setdefault(token, person)
        if window is not None:
            holders.insert(0, _held_over(window, namespace, name))
            known.add(1)
        slots = max(known, default=None)
        where = f"advisory key {keys.slots[0]}" + (
            f", gate {keys.gate}" if slots and slots > 1 else ""
        )
        waiters = tuple(head.values()) + tuple(v for k, v in queue.items() if k not in head)
        return LockState(namespace, name, where, slots, tuple(holders), waiters)


def _transient(err: BaseException | None) -> bool:
    """Whether *err* is a lost connection that a waiter may ride out (not a refusal).

    A server that restarts refuses connections, or says it is starting up, for a while.
    """
    if isinstance(err, BackendUnavailable):
        return "cancelled on the server" in str(err) or _transient(err.__cause__)
    if isinstance(err, psycopg.OperationalError):
        text = str(err)
        return not any(re.search(pattern, text, re.IGNORECASE) for pattern, _, _ in _FAILURES)
    return (
        isinstance(err, PgError)
        and not isinstance(err, NoAnswer)
        # a statement a DBA cancelled: the session lives, ask again (as MySQL's KILL QUERY)
        and (err.sqlstate is None or err.sqlstate in _ENDED or err.sqlstate == _QUERY_CANCELED)
    )


def _wait_for(seconds: float | None, key: int, *, shared: bool = False) -> str:
    """Return a statement that waits for *key* at most *seconds* (None: forever).

    lock_timeout is set in FROM, which runs before the target list; 0 would mean forever.
    A shared wait queues with the exclusive ones, in arrival order: a reader that comes
    after a queued writer waits behind it (PostgreSQL's lock queue, docs/design.md A8).
    """
    limit = 0 if seconds is None else min(_MAX_LOCK_TIMEOUT, max(1, math.ceil(seconds * 1000)))
    function = "pg_advisory_lock_shared" if shared else "pg_advisory_lock"
    return f"SELECT {function}({key}::bigint) FROM set_config('lock_timeout', '{limit}ms', false)"


def _others(keys: _Keys, slots: int) -> str:
    """Return the statement that finds users of another N and takers (`lockrun_others`)."""
    classid, objid = _halves(keys.stop)
    return f"EXECUTE lockrun_others({keys.agreed}, {slots}, {classid}, {objid})"


def _channel(keys: _Keys) -> str:
    """Return the LISTEN channel on which takers of a name ring its holders' bells."""
    return f"lockrun_{keys.stop & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def _parse_window(rows: list[tuple[str | None, ...]]) -> _Window | None:
    """Return the window in the rows of a read of it (`_WINDOW`), if one is open."""
    if not rows or not rows[0]:
        return None
    try:
        remaining = float(rows[0][0] or "")
    except ValueError:
        return None
    if not 0 < remaining < math.inf:  # NaN too
        return None
    return _Window(min(remaining, MAX_WAIT))


def _first_free(keys: _Keys) -> str:
    """Return a statement that takes the first free slot (CASE stops at the first) or -1."""
    tries = " ".join(
        f"WHEN pg_try_advisory_lock({key}) THEN {slot}" for slot, key in enumerate(keys.slots)
    )
    return f"SELECT CASE {tries} ELSE -1 END"


def _application_name(name: str, slot: int | str) -> str:
    """Return ``lockrun:NAME:SLOT`` in the 63 bytes PostgreSQL keeps, cut at a character."""
    suffix = f":{slot}"
    room = 63 - len("lockrun:") - len(suffix)
    cut = name.encode()[:room].decode(errors="ignore")
    return f"lockrun:{cut}{suffix}"


def _comment(request: Request, token: str, holder: Holder) -> str:
    """Return the comment every statement of a session carries: who runs it, for status."""
    return f"/* lockrun {_identity(request, token, holder)} */"


def _identity(request: Request, token: str, holder: Holder, room: int = _TAG_BYTES) -> str:
    """Return who runs a session's statements as JSON, for its comment or a window's row.

    ``/`` and ``*`` are escaped (valid JSON) so the text can neither end nor nest the
    comment (PostgreSQL nests ``/* */``); a long command line is cut so the whole fits
    *room* bytes: for a comment the 1024 bytes pg_stat_activity keeps.
    """
    argv = holder.argv
    while True:
        identity = {
            "token": token,
            "namespace": request.namespace,
            "name": request.name,
            "slots": request.slots,
            "holder": holder._replace(argv=argv).to_dict(),
        }
        text = json.dumps(identity).replace("/", "\\/").replace("*", "\\u002a")
        if len(text) <= room or not argv:
            return text
        argv = argv[: len(argv) // 2]


def _tagged(query: str) -> Identity | None:
    """Read the comment `_comment` wrote back from a statement; None if it is not ours.

    Any role of the database can run a statement with such a comment: it is read as
    untrusted (`read_identity`).
    """
    match = _TAGGED.search(query)
    return None if match is None else read_identity(match["json"])


def _give_way(
    rows: list[tuple[str | None, ...]], lease: _Lease, heard: AbstractSet[int] = frozenset()
) -> None:
    """Raise `TakenOver` if *rows* of stop key holders name a taker but *lease*'s own.

    A row is (pid, query, user, client, whether it waits), as `lockrun_others` and the check read.
    """
    taker = _taker(rows, lease, heard)
    if taker is not None:
        msg = f"taken over by {taker}"
        raise TakenOver(msg)


def _taker(
    rows: list[tuple[str | None, ...]], lease: _Lease, heard: AbstractSet[int]
) -> str | None:
    """Name the first taker in *rows* (`_give_way`'s) that is not *lease*'s own acquisition.

    A session that holds the stop key asks for a take-over, whoever it is, while it waits
    for a lock, or if it has just said so (a NOTIFY from its pid, in *heard*: its wait may
    not have begun when we looked). A stop key of a session that does neither is no
    request (a leftover). Its comment names the taker when it is a lockrun of this name
    (read as untrusted), else its role and client do.
    """
    for row in rows:
        pid, query, user, client, waiting = (*row, None, None, None, None, None)[:5]
        announced = (pid or "").isdigit() and int(pid or 0) in heard
        if waiting != "t" and not announced:
            continue
        who = _tagged(query or "")
        if who is not None and who.token == lease.token:
            continue  # our own first session, still at the gate (N > 1)
        if who is not None and (who.namespace, who.name) == lease.names:
            return f"{who.holder.user}@{who.holder.host} pid {who.holder.pid}"
        return f"{user or '?'}@{client or 'local socket'} (backend {pid})"
    return None


def _open_windows(rows: list[tuple[str | None, ...]]) -> dict[int, tuple[Identity | None, float]]:
    """Decode `status`'s rows of lockrun_holds (anyone's): key → (the run, if ours; its end)."""
    windows: dict[int, tuple[Identity | None, float]] = {}
    for row in rows:
        key, until, record = (*row, None, None, None)[:3]
        try:
            ends, slot = float(until or ""), int(key or "")
        except ValueError:
            continue
        if 0 < ends <= _MAX_STAMP:
            windows[slot] = (read_identity(record or ""), ends)
    return windows


def _held_over(window: tuple[Identity | None, float], namespace: str, name: str) -> Holder:
    """Describe the run whose --hold-at-least window is open, as its row says (untrusted)."""
    who, until = window
    if who is None or (who.namespace, who.name) != (namespace, name):  # not a row of ours
        return Holder(WINDOWS, 0, "?", (), slot=0, until=until)
    return who.holder._replace(slot=0, shared=False, expires=None, until=until)


def _stranger(pid: str | None, user: str | None, client: str | None, started: str | None) -> Holder:
    """Describe a session whose statements we may not read (another role's)."""
    where = client or "local socket"
    since = float(started) if started else None
    return Holder(f"{where} (backend {pid})", 0, user or "?", (), since=since)
