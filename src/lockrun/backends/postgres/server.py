"""The PostgreSQL server as lockrun's sessions find it: how they are opened, what it allows."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final, NamedTuple

import psycopg

from lockrun.backends import timeout_for
from lockrun.errors import BackendUnavailable, ConfigError, LockrunError

from .fences import FENCES, MAKE, TABLE, XACT
from .session import NOT_ALLOWED, NoAnswer, PgError, Session
from .uri import one_line, refusal

if TYPE_CHECKING:
    from collections.abc import Callable

    from .session import Row
    from .uri import Settings

V13: Final = 130000  # pg_current_xact_id()
V14: Final = 140000  # idle_session_timeout, client_connection_check_interval, waitstart
_V17: Final = 170000  # transaction_timeout
_CHECK_CLIENT: Final = "1s"  # how often a waiting server session looks for its client (14+)
# --hold-at-least: the window of a run that ended, as (lock key, end on the server's clock,
# the run's identity as JSON), created on first use (docs/design.md A8).
WINDOWS: Final = "lockrun_holds"
# Statements every session prepares: planning a join with pg_stat_activity takes longer
# than running it. EXECUTE takes our own values, formatted ints.
_PREPARED: Final = {
    # In one scan of pg_locks: the holders of (name, N) locks with N other than $2 (kind 2),
    # and the sessions holding the stop key (classid $3, objid $4; kind 1), with whether
    # each waits for an advisory lock (docs/design.md A8). Activity is read per row found:
    # pg_stat_get_activity of one pid, not the whole view. `rows.others` decodes its rows.
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
    # `rows.check` decodes its rows.
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


class Setup(NamedTuple):
    """What a new session's first statement says of it and of its server."""

    pid: int  # pg_backend_pid(): a pooler answers the connection with its own
    standby: bool  # pg_is_in_recovery()
    windows: bool  # whether the table of windows exists
    fences: bool  # whether the table of fences exists

    @classmethod
    def read(cls, row: Row) -> Setup:
        """Decode the row of `Server.setup`'s first statement."""
        return cls(int(row[0] or 0), row[1] == "t", row[2] == "t", row[3] == "t")


class Server:
    """Where sessions are opened, with timeouts that fit leases of *ttl*, and what we learnt."""

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        warn: Callable[[str], None],
        note: Callable[[str], None],
    ) -> None:
        """Remember *settings*; *warn* and *note* get one-line remarks (stderr, -v)."""
        self.settings = settings
        self.where = settings.where
        self.ttl = ttl
        self.warn = warn
        self.note = note
        self.timeout = timeout_for(ttl, durable=True)
        self.connect_timeout = max(2, math.ceil(self.timeout))  # libpq's least is 2 s
        self.version = 0  # server_version_num, once a session told it
        self.checked = False  # whether the server was found usable (a primary, no pooler)
        self.fences = MAKE  # where fences come from (`fences`: the table, once seen)
        # Whether a fallback fence (a transaction id) can be made durable (a logical message).
        self.durable = True
        # Whether the table of --hold-at-least windows exists (then every one-slot grant
        # reads it), and whether we said it cannot be read (`modes`).
        self.windows = False
        self.unreadable = False

    def session(self, tag: str = "/* lockrun */", label: str = "lockrun") -> Session:
        """Open a session whose locks the server frees after it idled for a lease.

        *label* is its application_name; a holder's becomes ``lockrun:NAME:SLOT``.
        """
        idle = max(1, int(self.ttl / 3))
        session = self.connect(
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
            self.setup(session, session.connection.info.server_version)
            if session.connection.info.backend_pid != session.pid and not self.checked:
                self.check_pooler(session)
            self.checked = True
        except PgError as err:
            session.abandon()
            raise self.failure(err) from err
        except BaseException:
            session.abandon()
            raise
        return session

    def connect(self, tag: str = "/* lockrun */", **options: str | int) -> Session:
        """Connect with libpq *options* beside the URI's; nothing else."""
        try:
            conninfo = psycopg.conninfo.make_conninfo(
                self.settings.conninfo, connect_timeout=self.connect_timeout, **options
            )
            connection = psycopg.Connection.connect(conninfo, autocommit=True)
        except psycopg.Error as err:
            raise self.failure(err) from err
        return Session(connection, tag)

    def setup(self, session: Session, version: int) -> None:
        """Set the lease and the waits' limits on *session*, learn its pid, refuse a standby.

        No statement timeout may cut a long wait short; a stalled holder keeps its locks
        only as long as its lease (idle_session_timeout, PostgreSQL 14+).
        """
        if version < V14 and not self.version:
            self.warn(
                f"{self.settings.where}: PostgreSQL {version // 10000} has no "
                "idle_session_timeout (14+), so a stalled holder keeps its lock until its "
                "connection breaks"
            )
        self.version = version
        calls = ", ".join(
            f"set_config('{name}', '{value}', false)" for name, value in self._limits(version)
        )
        # The grant's and the renewals' statements are planned once per session, not per
        # use; a pooler may hand us a server session that another client prepared them on.
        session.send_simple(
            f"SELECT pg_backend_pid(), pg_is_in_recovery(), "
            f"to_regclass('{WINDOWS}') IS NOT NULL, to_regclass('{FENCES}') IS NOT NULL, {calls}",
            "DEALLOCATE ALL",
            *_PREPARED.values(),
        )
        setup = Setup.read(session.answers(self.timeout)[0][0])
        session.pid = setup.pid
        self.windows = self.windows or setup.windows
        if setup.fences and self.fences in {MAKE, XACT}:
            self.fences = TABLE
        if setup.standby:
            msg = (
                f"{self.settings.where} is a standby (in recovery): its advisory locks are "
                "its own; point --uri at the primary (target_session_attrs=read-write)"
            )
            raise BackendUnavailable(msg)

    def _limits(self, version: int) -> list[tuple[str, str]]:
        """Return the settings (name, value) a session of a server of *version* gets."""
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
            # A fallback fence's commit, and a window's, wait for the disk.
            ("synchronous_commit", "local"),
        ]
        if version >= _V17:
            settings += [("transaction_timeout", "0")]  # it ends a session mid-wait
        if version >= V14:
            settings += [
                ("idle_session_timeout", lease),
                ("client_connection_check_interval", _CHECK_CLIENT),
            ]
        return settings

    def check_pooler(self, session: Session) -> None:
        """Refuse a pooler that shares server sessions between clients (docs/design.md P22).

        Something between us and the server answered with its own process id. In session
        pooling our server session is ours alone; in transaction pooling the session we
        just used goes back to the pool after each statement. A busy pool can still hide
        that; the holder's checks then find its lock on another session and stop the
        command (76).
        """
        other = self.connect()  # as a second client would
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
        text = one_line(self.settings, getattr(err, "message", None) or str(err))
        if isinstance(err, psycopg.ProgrammingError):  # libpq refused the URI
            return ConfigError(f"{where}: not a libpq connection URI: {text}")
        if isinstance(err, psycopg.errors.ConnectionTimeout):
            return BackendUnavailable(f"{where}: no answer within {self.connect_timeout}s")
        if isinstance(err, NoAnswer):
            return BackendUnavailable(f"{where}: {text}")
        return refusal(where, text) or BackendUnavailable(f"{where}: {text}")

    def said(self, err: BaseException) -> str:
        """Return the server's or libpq's words for *err*, in one line, without a password."""
        return one_line(self.settings, err.message if isinstance(err, PgError) else str(err))

    def durable_refused(self, err: PgError) -> bool:
        """Whether *err* refused the logical message that makes fences durable: note it."""
        if not self.durable or err.sqlstate not in NOT_ALLOWED:
            return False
        self.durable = False  # not allowed here (a managed service, say)
        self.note(
            f"{self.settings.where}: fences are transaction ids that a server crash may "
            f"repeat: pg_logical_emit_message is not allowed ({self.said(err)})"
        )
        return True
