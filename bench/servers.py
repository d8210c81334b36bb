"""The lock servers the bench measures against: the tests' throwaway ones, each with a probe.

tests/support/servers.py starts them; here each listens on a free loopback port too, so that
lockrun reaches it over TCP like a real deployment (and over its unix socket for reference).
The probe, one session of the bench's own on the socket, asks the server who waits and how
many clients it has; /proc says what CPU the server used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, cast

import pymysql
import pytest
import redis

from bench.core import (
    SERVED,
    Broken,
    Usage,
    context_switches,
    cpu_seconds,
    descendants,
    run_seconds,
)
from tests.support.servers import MariaServer, PostgresServer, RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import Iterator

    from bench.core import Bench

USER_LOCK: Final = "User lock"  # PROCESSLIST STATE of a session waiting inside GET_LOCK
# What a lockrun waiter puts after its GET_LOCK: who waits, with lockrun's pid.
WAITER_TAG: Final = re.compile(r"/\* lockrun (\{.*\}) \*/\s*\Z", re.DOTALL)
# The same before every PostgreSQL statement (pg_stat_activity keeps its first 1024 bytes);
# its JSON escapes every / and *, so the first */ ends it.
POSTGRES_TAG: Final = re.compile(r"/\* lockrun (\{[^*]*\}) \*/")
MAX_CONNECTIONS: Final = 400  # a session per idle waiter, and the holders
STARTS: Final = 3  # someone else may bind the free port before the server does


class Unavailable(Exception):
    """A server cannot run here; the message says why."""


class Server:
    """A throwaway lock server of the bench's own, and the bench's probe on it."""

    program: ClassVar[str]
    pauses: ClassVar[tuple[float, float]]  # between two looks at a queue: of one, of many
    probe: Any = None  # the bench's session, opened on first use

    def __init__(self, server: RedisServer | MariaServer | PostgresServer) -> None:
        self.server = server
        self.ready_in = 0.0  # seconds from a fresh data directory to the first session

    @property
    def uri(self) -> str:
        """The lock URI that reaches the server over TCP, like a real deployment."""
        return self.server.tcp_uri

    @property
    def socket_uri(self) -> str:
        """The lock URI that reaches the server over its unix socket."""
        return self.server.uri

    @property
    def pid(self) -> int:
        if self.server.process is None:
            msg = f"{self.program} is not running"
            raise Broken(msg)
        return self.server.process.pid

    def version(self) -> str:
        raise NotImplementedError

    def usage(self) -> Usage:
        """Sample the server now (Redis: its main thread does the work)."""
        return Usage.of(self.pid)

    def clients(self) -> tuple[int, int]:
        """Return how many clients are connected, not counting the probe, and how many wait."""
        raise NotImplementedError

    def waiting(self, name: str, pids: set[int]) -> set[int]:
        """Return which of the lockrun processes *pids* wait for *name* inside the server."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the probe, stop the server and remove its directory."""
        with contextlib.suppress(Exception):
            if self.probe is not None:
                self.probe.close()
        self.probe = None
        self.server.close()


class Redis(Server):
    """A redis-server; the probe is a redis-py client."""

    program = "redis-server"
    pauses = (0.005, 0.1)
    server: RedisServer

    def call(self, method: str, *args: str) -> object:
        """Call one of redis-py's methods on the probe."""
        if self.probe is None:
            self.probe = redis.Redis(unix_socket_path=self.server.socket, socket_timeout=5)
        try:
            return getattr(self.probe, method)(*args)  # type: ignore[no-any-return]
        except redis.RedisError as err:
            msg = f"redis-server on {self.server.socket}: {err}"
            raise Broken(msg) from err

    def info(self, part: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self.call("info", part))

    def version(self) -> str:
        return str(self.info("server")["redis_version"])

    def clients(self) -> tuple[int, int]:
        info = self.info("clients")
        return int(info["connected_clients"]) - 1, int(info["blocked_clients"])

    def waiting(self, name: str, pids: set[int]) -> set[int]:  # noqa: ARG002 - one lock at a time
        """Return which of *pids* sleep in a blocking command (BLPOP) on the server.

        CLIENT LIST names each blocked client's port; /proc/net/tcp turns the port into a
        socket inode, and the processes' fds say whose socket that is.
        """
        clients = cast("list[dict[str, str]]", self.call("client_list"))
        ports = {int(c["addr"].rpartition(":")[2]) for c in clients if "b" in c["flags"]}
        inodes = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            local, remote = (int(address.rpartition(":")[2], 16) for address in fields[1:3])
            if local in ports and remote == self.server.port:
                inodes.add(f"socket:[{fields[9]}]")
        found = set()
        for pid in pids:
            with contextlib.suppress(OSError):
                fds = Path(f"/proc/{pid}/fd")
                if any(os.readlink(fds / fd) in inodes for fd in os.listdir(fds)):
                    found.add(pid)
        return found


class Sql(Server):
    """A database server; the probe is a session of its driver, as root or lockrun."""

    def connect(self) -> object:
        raise NotImplementedError

    def errors(self) -> type[Exception]:
        raise NotImplementedError

    def query(
        self, sql: str, args: tuple[object, ...] | None = None
    ) -> tuple[tuple[Any, ...], ...]:
        """Run *sql* on the probe; return every row."""
        try:
            if self.probe is None:
                self.probe = self.connect()
            with self.probe.cursor() as cursor:
                cursor.execute(sql, args)
                return tuple(cursor.fetchall())
        except self.errors() as err:
            with contextlib.suppress(Exception):
                self.probe.close()
            self.probe = None
            msg = f"{self.program} on {self.server.directory}: {' '.join(str(err).split())}"
            raise Broken(msg) from err

    def tagged(
        self, sql: str, args: tuple[object, ...], tag: re.Pattern[str], name: str
    ) -> set[int]:
        """Return the lockrun pids in the `/* lockrun {json} */` tags of *sql*'s statements.

        The tag names the lock and the waiter's pid. The head of a semaphore's queue waits
        on the slots, the others on the gate: all are queued.
        """
        pids = set()
        for (statement,) in self.query(sql, args):
            match = tag.search(str(statement))
            with contextlib.suppress(ValueError, KeyError, TypeError):
                who = json.loads(match[1]) if match else {}
                if who and who["name"] == name:
                    pids.add(int(who["holder"]["pid"]))
        return pids


class Maria(Sql):
    """A mariadbd, with a thread per connection plus InnoDB's own."""

    program = "mariadbd"
    pauses = (0.002, 0.05)  # one PROCESSLIST query on the probe
    server: MariaServer

    def connect(self) -> object:
        return pymysql.connect(
            unix_socket=self.server.socket,
            user="root",
            password="",
            autocommit=True,
            connect_timeout=5,
            read_timeout=10,
            write_timeout=10,
        )

    def errors(self) -> type[Exception]:
        return pymysql.err.Error

    def version(self) -> str:
        return str(self.query("SELECT VERSION()")[0][0])

    def usage(self) -> Usage:
        """Sample the server's CPU, and its live threads' run time and switches.

        The main thread alone says nothing. A thread that ends between two samples takes its
        share of the exact numbers with it (the CPU column, the process's own, keeps it).
        """
        total = Usage(cpu_seconds(self.pid), 0.0, 0)
        for entry in os.listdir(f"/proc/{self.pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                task = int(entry)
                total += Usage(0.0, run_seconds(self.pid, task), context_switches(self.pid, task))
        return total

    def clients(self) -> tuple[int, int]:
        connected = self.query("SHOW GLOBAL STATUS LIKE 'Threads\\_connected'")[0][1]
        waiting = self.query(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = %s", (USER_LOCK,)
        )[0][0]
        return int(connected) - 1, int(waiting)

    def waiting(self, name: str, pids: set[int]) -> set[int]:  # noqa: ARG002 - the tags tell
        """Return the lockrun pids whose session is blocked in GET_LOCK ('User lock')."""
        sql = "SELECT INFO FROM information_schema.PROCESSLIST WHERE STATE = %s AND INFO LIKE %s"
        return self.tagged(sql, (USER_LOCK, "%/* lockrun %"), WAITER_TAG, name)


class Postgres(Sql):
    """A postgres: the postmaster, and a process per backend."""

    program = "postgres"
    pauses = (0.002, 0.05)  # one pg_stat_activity query on the probe
    server: PostgresServer

    def connect(self) -> object:
        import psycopg  # noqa: PLC0415 - the postgres extra is optional; `start` checked

        return psycopg.connect(
            host=self.server.directory,
            port=self.server.port,
            user="lockrun",
            dbname="lockrun",
            autocommit=True,
            connect_timeout=5,
            options="-c statement_timeout=10s",
        )

    def errors(self) -> type[Exception]:
        import psycopg  # noqa: PLC0415

        return psycopg.Error

    def version(self) -> str:
        return str(self.query("SHOW server_version")[0][0])

    def usage(self) -> Usage:
        """Sample the postmaster and its children (a process per backend).

        The postmaster's cutime and cstime keep what the backends it reaped used, so a
        backend that ends between two samples still counts in the CPU column; its run time
        and switches (the exact numbers) leave with it. Each process's utime + stime is its
        run time cut to whole clock ticks: a young backend that used less than a tick in all
        shows none, so with many of them the CPU column reads low and the exact one is right.
        """
        total = Usage.of(self.pid) + Usage(cpu_seconds(self.pid, slice(13, 15)), 0.0, 0)
        for child in descendants({self.pid}):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += Usage.of(child)
        return total

    def clients(self) -> tuple[int, int]:
        """Return how many sessions use lockrun's database (not the probe), and how many wait."""
        connected, waiting = self.query(
            "SELECT count(*), count(*) FILTER (WHERE pid IN (SELECT pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND NOT granted)) FROM pg_stat_activity "
            "WHERE datname = 'lockrun' AND pid <> pg_backend_pid()"
        )[0]
        return int(connected), int(waiting)

    def waiting(self, name: str, pids: set[int]) -> set[int]:  # noqa: ARG002 - the tags tell
        """Return the lockrun pids whose session waits for an advisory lock.

        pg_locks says who waits, not pg_stat_activity's wait_event: a waiting backend wakes
        every second (lockrun's client_connection_check_interval) and shows no wait event
        until it sleeps again, which on a busy machine a look at 100 waiters often catches.
        """
        sql = (
            "SELECT query FROM pg_stat_activity WHERE pid IN (SELECT pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND NOT granted) AND query LIKE %s"
        )
        return self.tagged(sql, ("%/* lockrun %",), POSTGRES_TAG, name)


def launch(backend: str, port: int) -> Server:
    """Start *backend*'s server on loopback *port*, with room for every waiter's session."""
    if backend == "redis":
        return Redis(RedisServer(port=port))
    if backend == "mysql":
        return Maria(MariaServer(f"--max-connections={MAX_CONNECTIONS}", port=port))
    if importlib.util.find_spec("psycopg") is None:
        msg = "psycopg is not installed (pip install -e '.[postgres]')"
        raise Unavailable(msg)
    return Postgres(PostgresServer(f"max_connections={MAX_CONNECTIONS}", port=port))


def start(backend: str) -> Server:
    """Start *backend*'s server and open the probe; `Unavailable` with the reason if not."""
    began = time.monotonic()
    for attempt in range(1, STARTS + 1):
        try:
            server = launch(backend, free_port())
        except pytest.skip.Exception as err:  # not installed
            raise Unavailable(str(err)) from None
        except (pytest.fail.Exception, OSError, subprocess.SubprocessError) as err:
            reason = " | ".join(str(err).strip().splitlines()[-3:])
            if attempt == STARTS or "in use" not in reason:
                raise Unavailable(reason) from None
            continue
        try:
            server.version()
        except Broken as err:
            server.close()
            raise Unavailable(str(err)) from err
        server.ready_in = time.monotonic() - began
        return server
    raise AssertionError  # unreachable: the last attempt returns or raises


@contextlib.contextmanager
def serving(bench: Bench, backend: str) -> Iterator[Server | None]:
    """Run *backend*'s server for *bench* while the block runs; None for a local backend."""
    if backend not in SERVED:
        yield None
        return
    server = start(backend)
    bench.servers[backend] = server
    try:
        yield server
    finally:
        del bench.servers[backend]
        server.close()
