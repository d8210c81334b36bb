"""The lock servers the bench measures against: the tests' throwaway ones, each with a probe.

Each listens on a free loopback port too: lockrun reaches it over TCP like a real deployment.
The probe, a session of the bench's own on the unix socket, asks who waits and how many.
etcd, lockrun's etcd backend's server and `etcdctl lock`'s beside every server backend, is
asked over its JSON gateway and its metrics (it has no unix socket).

Every server keeps its production durability, so that no side of a ratio skips a flush the
other pays (`durability` says which): PostgreSQL fsyncs (the tests' servers do not), MariaDB
flushes InnoDB's log at every commit (its default), etcd's data is on the disk, and Redis
appends every write to its AOF, fsynced once a second (its usual durable setting; Redis
never waits for a disk on a write but with `appendfsync always`).
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar, cast

import pymysql
import pytest
import redis

from bench.core import (
    CLOCK_TICKS,
    ETCD,
    ETCDCTL_LOCK,
    LOCAL,
    Broken,
    Usage,
    descendants,
    stat_fields,
)
from tests.support.servers import (
    EtcdServer,
    MariaServer,
    PostgresServer,
    RedisServer,
    free_port,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from subprocess import Popen

    from bench.core import Bench, Target

# What a lockrun waiter's statement carries: who waits, lock name and pid. Its JSON never
# holds a */ (MySQL's escapes it, PostgreSQL's every / and *), so the first */ ends it.
TAG: Final = re.compile(r"/\* lockrun (\{.*?\}) \*/", re.DOTALL)
USER_LOCK: Final = "User lock"  # PROCESSLIST STATE of a session waiting inside GET_LOCK
MAX_CONNECTIONS: Final = 400  # a session per idle waiter, and the holders
STARTS: Final = 3  # someone else may bind the free port before the server does
T = TypeVar("T")
# etcd's gauges of watches, all of them and those not yet caught up (GET /metrics).
WATCHERS: Final = "etcd_debugging_mvcc_watcher_total"
UNSYNCED: Final = "etcd_debugging_mvcc_slow_watcher_total"
LOCKRUN_KEYS: Final = "lockrun"  # the etcd backend's keys: lockrun/NS/NAME/q/LEASE (A13)
ESTABLISHED: Final = "01"  # a TCP connection's state in /proc/net/tcp


class Unavailable(Exception):
    """A server cannot run here; the message says why."""


class Server:
    """A throwaway server of the bench's own, and its probe.

    `clients` counts its clients but the probe, and those waiting; `waiting` says which of
    *pids* wait for a target's lock in it.
    """

    program: ClassVar[str]
    durability: ClassVar[str]  # how the server keeps a write, for the report
    pauses: ClassVar[tuple[float, float]] = (0.002, 0.05)  # between looks at a queue of 1, of N
    sockets: ClassVar[bool] = True  # also time handoffs over its unix socket (not --quick)
    probe: Any = None  # the bench's session, opened on first use

    def __init__(self, server: RedisServer | MariaServer | PostgresServer | EtcdServer) -> None:
        self.server = server
        self.ready_in = 0.0  # seconds from a fresh data directory to the first session
        self.uri, self.socket_uri = server.tcp_uri, server.uri
        self.endpoint = self.uri  # where a peer's own client connects (`etcdctl lock`'s)

    @property
    def pid(self) -> int:
        return cast("Popen[bytes]", self.server.process).pid

    def connect(self) -> Any:  # noqa: ANN401 - the driver's connection
        raise NotImplementedError

    def version(self) -> str:
        raise NotImplementedError

    def clients(self) -> tuple[int, int]:
        raise NotImplementedError

    def waiting(self, target: Target, pids: set[int]) -> set[int]:
        raise NotImplementedError

    def sessions(self, waiters: int, slots: int) -> int:
        """Return how many sessions *waiters* queued behind *slots* holders may open.

        One per waiter, and N - 1 more for the head, which waits on every slot.
        """
        return waiters + slots - 1

    def held_by(self, slots: int) -> int:
        """Return how many sessions *slots* holders keep open: one each."""
        return slots

    def usage(self) -> Usage:
        """Sample the server now (Redis: its main thread does the work)."""
        return Usage.of(self.pid)

    def ask(self, question: Callable[[Any], T]) -> T:
        """Put *question* to the probe; `Broken` (and a new probe next time) if it fails."""
        try:
            if self.probe is None:
                self.probe = self.connect()
            return question(self.probe)
        except Exception as err:  # the driver's
            self.close_probe()
            msg = f"{self.program} on {self.server.directory}: {' '.join(str(err).split())}"
            raise Broken(msg) from err

    def query(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        """Run *sql* on the probe; return every row."""

        def run(connection: Any) -> list[tuple[Any, ...]]:  # noqa: ANN401
            with connection.cursor() as cursor:
                cursor.execute(sql, args or None)
                return list(cursor.fetchall())

        return self.ask(run)

    def tagged(self, name: str, sql: str, *args: object) -> set[int]:
        """Return the pids the lockrun tags name *name* in, in the statements *sql* lists."""
        # The head of a semaphore's queue waits on the slots, the others on the gate: all queue.
        pids = set()
        for (statement,) in self.query(sql, *args):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                who = json.loads(TAG.search(str(statement))[1])  # type: ignore[index]
                pids |= {int(who["holder"]["pid"])} if who["name"] == name else set()
        return pids

    def close_probe(self) -> None:
        with contextlib.suppress(Exception):
            self.probe.close()
        self.probe = None

    def close(self) -> None:
        """Close the probe, stop the server and remove its directory."""
        self.close_probe()
        self.server.close()


class Redis(Server):
    program, pauses = "redis-server", (0.005, 0.1)
    durability = "appendonly yes, appendfsync everysec"
    sockets = False  # `waiting` finds the blocked clients by their TCP port
    server: RedisServer

    def connect(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=self.server.socket, socket_timeout=5)

    def version(self) -> str:
        return str(self.ask(lambda probe: probe.info("server"))["redis_version"])

    def clients(self) -> tuple[int, int]:
        info = self.ask(lambda probe: probe.info("clients"))
        return int(info["connected_clients"]) - 1, int(info["blocked_clients"])

    def waiting(self, target: Target, pids: set[int]) -> set[int]:  # noqa: ARG002 - one at once
        """Return which of *pids* sleep in a blocking command (BLPOP) on the server.

        CLIENT LIST names each blocked client's port; /proc/net/tcp turns the port into a
        socket inode, and the processes' fds say whose socket that is.
        """
        clients = self.ask(lambda probe: probe.client_list())
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


class Maria(Server):
    program = "mariadbd"
    durability = "innodb_flush_log_at_trx_commit=1 (its default): a flush per commit"
    server: MariaServer

    def connect(self) -> pymysql.Connection[Any]:
        timeouts: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 10, "write_timeout": 10}
        return pymysql.connect(
            unix_socket=self.server.socket, user="root", autocommit=True, **timeouts
        )

    def version(self) -> str:
        return str(self.query("SELECT VERSION()")[0][0])

    def usage(self) -> Usage:
        """Sample the server: a thread per connection plus InnoDB's own (`threads_usage`)."""
        return threads_usage(self.pid)

    def clients(self) -> tuple[int, int]:
        connected = self.query("SHOW GLOBAL STATUS LIKE 'Threads\\_connected'")[0][1]
        sql = "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = %s"
        return int(connected) - 1, int(self.query(sql, USER_LOCK)[0][0])

    def waiting(self, target: Target, pids: set[int]) -> set[int]:  # noqa: ARG002 - tags tell
        """Return the lockrun pids whose session is blocked in GET_LOCK ('User lock')."""
        sql = "SELECT INFO FROM information_schema.PROCESSLIST WHERE STATE = %s AND INFO LIKE %s"
        return self.tagged(target.name, sql, USER_LOCK, "%/* lockrun %")


class Postgres(Server):
    program = "postgres"
    durability = "fsync=on, synchronous_commit=on (its defaults)"
    server: PostgresServer

    def connect(self) -> Any:  # noqa: ANN401 - psycopg is optional: `launch` checked
        import psycopg  # noqa: PLC0415

        where = f"host={self.server.directory} port={self.server.port} connect_timeout=5"
        options = "-c statement_timeout=10s"
        return psycopg.connect(
            f"{where} user=lockrun dbname=lockrun", autocommit=True, options=options
        )

    def version(self) -> str:
        return str(self.query("SHOW server_version")[0][0])

    def usage(self) -> Usage:
        """Sample the postmaster and its children (a process per backend).

        Its cutime and cstime keep what the backends it reaped used, so one that ends between
        two samples still counts in the CPU column; its exact run time and switches leave with
        it. Each utime + stime is cut to whole clock ticks: a young backend that used less than
        a tick shows none, so with many the CPU column reads low and the exact one is right.
        """
        reaped = sum(map(int, stat_fields(Path(f"/proc/{self.pid}"))[13:15])) / CLOCK_TICKS
        total = Usage.of(self.pid) + Usage(reaped, 0.0, 0)
        for child in descendants({self.pid}):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += Usage.of(child)
        return total

    def clients(self) -> tuple[int, int]:
        """Count the sessions on lockrun's database (but the probe), and those waiting."""
        connected, waiting = self.query(
            "SELECT count(*), count(*) FILTER (WHERE pid IN (SELECT pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND NOT granted)) FROM pg_stat_activity "
            "WHERE datname = 'lockrun' AND pid <> pg_backend_pid()"
        )[0]
        return int(connected), int(waiting)

    def waiting(self, target: Target, pids: set[int]) -> set[int]:  # noqa: ARG002 - tags tell
        """Return the lockrun pids whose session waits for an advisory lock.

        pg_locks says who waits, not pg_stat_activity's wait_event: a waiting backend wakes
        every second (lockrun's client_connection_check_interval) and shows no wait event
        until it sleeps again, which on a busy machine a look at 100 waiters often catches.
        """
        sql = "SELECT query FROM pg_stat_activity WHERE pid IN (SELECT pid FROM pg_locks "
        sql += "WHERE locktype = 'advisory' AND NOT granted) AND query LIKE %s"
        return self.tagged(target.name, sql, "%/* lockrun %")


class Etcd(Server):
    """The etcd backend's server, and `etcdctl lock`'s; asked over its gateway, no probe session.

    lockrun reaches it at ``etcd://127.0.0.1:PORT`` (`uri`), etcdctl and the bench at its
    client URL (`endpoint`), the same member.
    """

    program, sockets = "etcd", False
    durability = "data on the disk, an fsync per write (etcd's only way)"
    server: EtcdServer

    def __init__(self, server: EtcdServer) -> None:
        super().__init__(server)
        self.endpoint = server.uri
        self.uri = self.socket_uri = f"etcd://127.0.0.1:{server.port}"

    def call(self, path: str, body: dict[str, object] | None = None) -> Any:  # noqa: ANN401 - JSON
        """GET *path* of etcd's JSON gateway, or POST *body* to it; `Broken` if that fails."""
        data = None if body is None else json.dumps(body).encode()
        try:
            # S310: the URL is our own server's, http on loopback.
            with urllib.request.urlopen(self.endpoint + path, data, timeout=5) as answer:  # noqa: S310
                return json.load(answer)
        except (OSError, ValueError) as err:
            raise Broken(f"{self.program} on {self.endpoint}: {err}") from err

    def version(self) -> str:
        return str(self.call("/version")["etcdserver"])

    def usage(self) -> Usage:
        """Sample the server: Go runs its goroutines on a few threads (`threads_usage`)."""
        return threads_usage(self.pid)

    def clients(self) -> tuple[int, int]:
        """Count the TCP connections to etcd from other processes, and its watches.

        etcd's gateway speaks to etcd itself over a connection of its own: not a client's.
        """
        own = socket_inodes(self.pid)
        connected = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            remote = int(fields[2].rpartition(":")[2], 16)
            mine = f"socket:[{fields[9]}]" in own
            connected += remote == self.server.port and fields[3] == ESTABLISHED and not mine
        return connected, int(self.gauges().get(WATCHERS, 0))

    def sessions(self, waiters: int, slots: int) -> int:  # noqa: ARG002 - the same for any N
        """Return 2 connections a waiter: its calls' and its watch's (A13: a stream each)."""
        return 2 * waiters

    def held_by(self, slots: int) -> int:
        """Return the holders' connections: one each, and a one-slot holder's take-over bell."""
        return slots + (slots == 1)

    def waiting(self, target: Target, pids: set[int]) -> set[int]:
        """Return *pids* once each has a key in *target*'s queue and a synced watch: queued.

        A waiter's key comes before its watch on the key ahead of it (or on the queue), and
        etcd 3.4 starts a watch that asks from a revision already written *unsynced*, and
        catches unsynced watches up every 100 ms: a release in between reaches the waiter up
        to 100 ms late, a queue set-up, not a hand-over. So a waiter counts as queued once
        etcd's own gauges (GET /metrics) show a watch for each waiter and none unsynced
        (../shared/research/turn3/performance.md, section 0), lockrun's and `etcdctl lock`'s
        alike.
        """
        if target.kind == ETCDCTL_LOCK:
            keyed = pids if self.etcdctl_keys(target.name) > len(pids) else set()
        else:
            keyed = self.lockrun_keys(target.name) & pids
        if len(keyed) < len(pids):
            return keyed  # not all there yet: no need to look at the watches
        gauges = self.gauges()
        watching = gauges.get(WATCHERS, 0) >= len(pids) and gauges.get(UNSYNCED, 1) == 0
        return pids if watching else set()

    def etcdctl_keys(self, name: str) -> int:
        """Return how many keys `etcdctl lock` has under *name*: its holder's and waiters'.

        It puts a key NAME/LEASE for each; a lease id names no process, so the count decides.
        """
        key, end = (base64.b64encode(f"{name}{last}".encode()).decode() for last in "/0")
        found = self.call("/v3/kv/range", {"key": key, "range_end": end, "count_only": True})
        return int(found.get("count", 0))  # JSON omits a 0

    def lockrun_keys(self, name: str) -> set[int]:
        """Return the pids of the lockruns with a queue key of lock *name* (holders too).

        Each queue key's value is its acquirer's record (docs/backends.md "etcd"), as the
        SQL backends' tags: the lock's name and the holder's pid.
        """
        key, end = (base64.b64encode(f"{LOCKRUN_KEYS}{last}".encode()).decode() for last in "/0")
        found = self.call("/v3/kv/range", {"key": key, "range_end": end})
        pids = set()
        for kv in found.get("kvs", []):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                who = json.loads(base64.b64decode(kv["value"]))
                pids |= {int(who["holder"]["pid"])} if who["name"] == name else set()
        return pids

    def gauges(self) -> dict[str, float]:
        """Return etcd's watch gauges from its Prometheus text (GET /metrics)."""
        try:
            # S310: the URL is our own server's, http on loopback.
            with urllib.request.urlopen(self.endpoint + "/metrics", timeout=5) as answer:  # noqa: S310
                text = answer.read().decode()
        except (OSError, ValueError) as err:
            raise Broken(f"{self.program} on {self.endpoint}: {err}") from err
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in (WATCHERS, UNSYNCED):
                found[name] = float(value)
        return found


def threads_usage(pid: int) -> Usage:
    """Sample process *pid*'s CPU, and its live threads' run time and switches.

    A thread that ends between two samples takes its share of the exact numbers with it
    (the CPU column, the process's own, keeps it).
    """
    total = Usage(Usage.of(pid).cpu, 0.0, 0)
    for entry in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            thread = Usage.of(pid, int(entry))
            total += Usage(0.0, thread.run, thread.switches)
    return total


def socket_inodes(pid: int) -> set[str]:
    """Return the sockets among *pid*'s open files, as /proc/PID/fd names them."""
    found = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):
            found.add(os.readlink(fds / fd))
    return {name for name in found if name.startswith("socket:")}


def launch(backend: str, port: int) -> Server:
    """Start *backend*'s server on loopback *port*, with room for every waiter's session."""
    if backend == ETCD:
        return Etcd(EtcdServer(port=port, peer_port=free_port(), durable=True))
    if backend == "redis":
        return Redis(RedisServer("--appendonly", "yes", "--appendfsync", "everysec", port=port))
    if backend == "mysql":
        durable = "--innodb-flush-log-at-trx-commit=1"  # the default, said aloud
        return Maria(MariaServer(f"--max-connections={MAX_CONNECTIONS}", durable, port=port))
    if importlib.util.find_spec("psycopg") is None:
        raise Unavailable("psycopg is not installed (pip install -e '.[postgres]')")  # noqa: EM101
    settings = f"max_connections={MAX_CONNECTIONS}"
    return Postgres(PostgresServer(settings, port=port, durable=True))


@contextlib.contextmanager
def serving(bench: Bench, backend: str) -> Iterator[Server | None]:
    """Run *backend*'s server (etcd: also `etcdctl lock`'s) for *bench* while the block runs.

    None for a local backend; raise `Unavailable` if it cannot run here. A server already
    running for *bench* is the one given: `etcdctl lock` on the etcd group's own etcd.
    """
    if backend in LOCAL:
        yield None
        return
    if (running := bench.servers.get(backend)) is not None:
        yield running
        return
    began = time.monotonic()
    for attempt in range(1, STARTS + 1):
        try:
            server = launch(backend, free_port())
            break
        except pytest.skip.Exception as err:  # not installed
            raise Unavailable(str(err)) from None
        except (pytest.fail.Exception, OSError, subprocess.SubprocessError) as err:
            reason = " | ".join(str(err).strip().splitlines()[-3:])
            if attempt == STARTS or "in use" not in reason:
                raise Unavailable(reason) from None
    try:
        server.version()  # the first session
    except Broken as err:
        server.close()
        raise Unavailable(str(err)) from err
    server.ready_in = time.monotonic() - began
    bench.servers[backend] = server
    try:
        yield server
    finally:
        del bench.servers[backend]
        server.close()
