"""One harness per backend: where a lock lives, and how the tests break what holds it.

The contract suites (tests/contract) run each scenario once per backend of the scheme
registry (`lockrun.uri.BACKENDS`) through a `Harness`: a URI (and, for a server, the same
server through a `Proxy`), the registry's `Scheme` as `kind` (what the backend holds a lock
with: `inherits_fds`, `leased`, `session`, `local`), and the faults the tests inject — a
server restart, the end of the session (or lease) that holds a lock, a silent partition, a
paused lockrun. What the registry cannot know is a harness capability (`can_restart`,
`can_partition`, `can_end_session`); a test asks for those, never for a backend's name.

Loaded by tests/conftest.py as a plugin (`pytest_plugins`), so that its fixtures reach every
test without a second module called ``conftest``: `harness` (each backend, a server of the
test's own), `server_harness` (the server backends only), `shared_harness` (each backend on
the session's servers: cheap, but nothing that would disturb other tests), and the chaos
suite's `rig`, `target`, `oracle` and `record`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Final, Protocol

import pytest

from lockrun.uri import BACKENDS, SCHEMES, Scheme
from tests.support.oracle import Oracle
from tests.support.proxy import Proxy
from tests.support.servers import MariaServer, PostgresServer, RedisServer, free_port

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterator
    from pathlib import Path

SERVERS: Final = tuple(backend for backend in BACKENDS if not SCHEMES[backend].local)
LOCAL: Final = tuple(backend for backend in BACKENDS if SCHEMES[backend].local)

# Room for 200 waiters and their helpers, the scale test's crowd.
_ROOMY: Final = {
    "redis": ("--maxclients", "2000"),
    "mysql": ("--max-connections=1000",),
    "postgres": ("max_connections=600",),
}
# How to count a server's client connections, leaving out the one that asks.
_MYSQL_SESSIONS: Final = (
    "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
    " WHERE ID <> CONNECTION_ID() AND COMMAND <> 'Daemon' AND USER <> 'system user'"
)
_POSTGRES_SESSIONS: Final = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
)
NAMESPACE: Final = "default"


# -- processes ------------------------------------------------------------------------------------


def stopped(pid: int) -> bool:
    """Return whether *pid* is stopped (SIGSTOP took effect)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"


def pause(process: subprocess.Popen[str] | int) -> None:
    """SIGSTOP *process* (a lockrun, or any pid) and wait until the kernel has stopped it."""
    pid = process if isinstance(process, int) else process.pid
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def resume(process: subprocess.Popen[str] | int) -> None:
    """SIGCONT *process*."""
    os.kill(process if isinstance(process, int) else process.pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(process: subprocess.Popen[str] | int) -> Iterator[None]:
    """Keep *process* stopped for the block; it resumes however the block ends."""
    pause(process)
    try:
        yield
    finally:
        resume(process)


# -- the protocol and its implementations ---------------------------------------------------------


class Harness:
    """Where a lock of one backend lives, and the faults a test can inject there.

    `uri` reaches the lock directly; `proxied` (None without a proxy) reaches the same
    server through `proxy`, so that lockrun processes can be put on either side of a
    partition. `kind` is the registry's `Scheme` of the backend. A fault the harness cannot
    inject has its capability False and raises `NotImplementedError` if asked anyway.
    """

    backend: str  # the registry's backend name: "file", "redis", …
    uri: str
    proxied: str | None = None
    proxy: Proxy | None = None
    server: RedisServer | MariaServer | PostgresServer | None = None
    can_restart = False  # restart() loses every session (and Redis its data)
    can_partition = False  # partition() silences the proxy
    can_end_session = False  # end_session() takes a lock from its holder

    @property
    def kind(self) -> Scheme:
        """The registry's row for this backend: what it holds a lock with."""
        return SCHEMES[self.backend]

    def __repr__(self) -> str:
        """Name the backend and the URI (pytest shows it in failures)."""
        return f"<{type(self).__name__} {self.backend} {self.uri}>"

    @property
    def lost_reason(self) -> str | None:
        """What lockrun's one line says once `end_session` took its lock; None: no reason asked."""
        return "the session holding the lock ended" if self.kind.session else None

    def restart(self) -> None:
        """Kill the server and start it again: every session, and what it held, is gone."""
        raise NotImplementedError(self.backend)

    def end_session(self, name: str, slot: int = 0) -> None:
        """Take *name*'s *slot* away from its holder, the backend's way."""
        raise NotImplementedError(self.backend)

    def partition(self) -> None:
        """Drop every byte between `proxied` clients and the server, keeping sockets open."""
        if self.proxy is None:
            raise NotImplementedError(self.backend)
        self.proxy.blackhole()

    def sessions(self) -> int:
        """Return how many client connections the server has now, not counting ours."""
        raise NotImplementedError(self.backend)

    # Pausing a lockrun is the same on every backend; here so that a test needs one object.
    pause = staticmethod(pause)
    resume = staticmethod(resume)
    paused = staticmethod(paused)

    def close(self) -> None:
        """Let go of everything the harness started."""


class LocalHarness(Harness):
    """file: in a private directory, or abstract: under a private prefix: no server at all."""

    def __init__(self, backend: str, tmp_path: Path) -> None:
        """Describe a *backend* lock private to the test of *tmp_path*."""
        self.backend = backend
        if backend == "file":
            self.uri = f"file://{tmp_path}/locks"
        else:
            self.uri = f"{backend}:test-{uuid.uuid4().hex[:8]}"


class ServerHarness(Harness):
    """A server backend: either a server of the test's own (with a proxy) or a shared URI."""

    def __init__(self, backend: str, uri: str | None = None, *options: str) -> None:
        """Start a *backend* server of our own (with *options*) and a proxy; or use *uri*.

        On a shared *uri* nothing may disturb the other tests: no restart, no partition.
        """
        self.backend = backend
        self._counter: Callable[[], int] | None = None
        self._closer: Callable[[], object] = lambda: None
        if uri is not None:
            self.uri = uri
            return
        port = free_port()
        self.server = _SERVER[backend](*options, port=port)
        self.proxy = Proxy(("127.0.0.1", port))
        self.uri = self.server.tcp_uri
        self.proxied = self.uri.replace(f":{port}/", f":{self.proxy.port}/")
        self.can_restart = self.can_partition = True  # only on a server of the test's own

    can_end_session = True

    @property
    def socket_uri(self) -> str:
        """The own server's unix-socket URI (no TCP, no proxy)."""
        assert self.server is not None, "a shared server has no socket of ours"
        return self.server.uri

    def restart(self) -> None:
        """Kill the server and start it again (Redis comes back empty)."""
        if self.server is None:
            raise NotImplementedError(f"{self.backend}: a shared server")
        self._forget_counter()
        self.server.restart()

    def sessions(self) -> int:
        """Return how many client connections the server has now, not counting ours."""
        if self._counter is None:
            self._counter, self._closer = self._connect_counter()
        return self._counter()

    def close(self) -> None:
        """Stop the proxy and the server (a shared server is left alone)."""
        self._forget_counter()
        if self.proxy is not None:
            self.proxy.close()
        if self.server is not None:
            self.server.close()

    def _connect_counter(self) -> tuple[Callable[[], int], Callable[[], object]]:
        raise NotImplementedError

    def _forget_counter(self) -> None:
        if self._counter is not None:
            with contextlib.suppress(Exception):
                self._closer()
            self._counter = None


class RedisHarness(ServerHarness):
    """Redis: the lock is a lease in keys; ending the session deletes them."""

    def client(self) -> Any:
        """Return a redis-py client of our own on the server (close it when done)."""
        import redis

        return redis.Redis.from_url(self.uri)

    def end_session(self, name: str, slot: int = 0) -> None:  # noqa: ARG002 - one lease key
        """Make the server forget *name*: FLUSHALL on our own server, else DEL its keys."""
        with contextlib.closing(self.client()) as client:
            if self.server is not None:
                client.flushall()
            else:
                keys = client.keys(f"lockrun:{{{NAMESPACE}/{name}}}:*")
                if keys:
                    client.delete(*keys)

    def _connect_counter(self) -> tuple[Callable[[], int], Callable[[], object]]:
        client = self.client()
        return lambda: int(client.info("clients")["connected_clients"]) - 1, client.close


class MysqlHarness(ServerHarness):
    """MySQL/MariaDB: the lock is a GET_LOCK of lockrun's session; ending it is a KILL."""

    def connect(self) -> Any:
        """Open a pymysql session of our own (not lockrun's) on the server."""
        import pymysql

        from lockrun.backends import parse_uri
        from lockrun.backends.mysql import parse

        settings = parse(parse_uri(self.uri))
        return pymysql.connect(**settings.kwargs, autocommit=True, connect_timeout=5)

    def query(self, sql: str, args: object = None) -> tuple[tuple[Any, ...], ...]:
        """Run *sql* on a fresh session of our own and return every row."""
        with contextlib.closing(self.connect()) as connection, connection.cursor() as cursor:
            cursor.execute(sql, args)
            return tuple(cursor.fetchall())

    def owner(self, name: str, slot: int | str = 0) -> int | None:
        """Return the connection id holding *name*'s *slot* (or "gate"), None if it is free."""
        from lockrun.backends.mysql import lock_key

        lock = f"{lock_key(NAMESPACE, name)}:{slot}"
        ((holder,),) = self.query("SELECT IS_USED_LOCK(%s)", (lock,))
        return None if holder is None else int(holder)

    def end_session(self, name: str, slot: int = 0) -> None:
        """KILL CONNECTION the session that holds *name*'s *slot*."""
        connection = self.owner(name, slot)
        assert connection is not None, f"nobody holds {name}:{slot}"
        self.query(f"KILL CONNECTION {connection:d}")

    def _connect_counter(self) -> tuple[Callable[[], int], Callable[[], object]]:
        connection = self.connect()

        def count() -> int:
            with connection.cursor() as cursor:
                cursor.execute(_MYSQL_SESSIONS)
                (found,) = cursor.fetchone() or (0,)
            return int(found)

        return count, connection.close


class PostgresHarness(ServerHarness):
    """PostgreSQL: the lock is an advisory lock of lockrun's session; ending it terminates it."""

    def connect(self) -> Any:
        """Open a psycopg session of our own (not lockrun's) on the server, autocommit."""
        import psycopg

        return psycopg.connect(self.uri, autocommit=True, connect_timeout=10)

    def query(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        """Run *sql* on a fresh session of our own and return every row."""
        with self.connect() as connection:
            rows: list[tuple[Any, ...]] = connection.execute(sql, params or None).fetchall()
            return rows

    def named(self, name: str) -> list[int]:
        """Return the server processes whose application_name says they hold a slot of *name*."""
        rows = self.query(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s ORDER BY pid",
            f"lockrun:{name}:%",
        )
        return [int(pid) for (pid,) in rows]

    def end_session(self, name: str, slot: int = 0) -> None:
        """pg_terminate_backend the session that holds *name*'s *slot*."""
        rows = self.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            f"lockrun:{name}:{slot}",
        )
        assert rows == [(True,)], f"nobody holds {name}:{slot} ({rows})"

    def _connect_counter(self) -> tuple[Callable[[], int], Callable[[], object]]:
        session = self.connect()

        def count() -> int:
            (found,) = session.execute(_POSTGRES_SESSIONS).fetchone() or (0,)
            return int(found)

        return count, session.close


_SERVER: Final[dict[str, type[RedisServer | MariaServer | PostgresServer]]] = {
    "redis": RedisServer,
    "mysql": MariaServer,
    "postgres": PostgresServer,
}
_HARNESS: Final[dict[str, type[ServerHarness]]] = {
    "redis": RedisHarness,
    "mysql": MysqlHarness,
    "postgres": PostgresHarness,
}


def make_harness(backend: str, tmp_path: Path, *options: str) -> Harness:
    """Return a harness of *backend* with a server of its own (extra *options*) if it has one."""
    if SCHEMES[backend].local:
        return LocalHarness(backend, tmp_path)
    return _HARNESS[backend](backend, None, *(options or _ROOMY[backend]))


def shared_harness_for(backend: str, tmp_path: Path, uri: str | None = None) -> Harness:
    """Return a harness of *backend* on a shared server at *uri* (local backends need none)."""
    if SCHEMES[backend].local:
        return LocalHarness(backend, tmp_path)
    assert uri is not None
    return _HARNESS[backend](backend, uri)


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each backend, with a server (and proxy) of the test's own, closed at teardown."""
    made = make_harness(request.param, tmp_path)
    yield made
    made.close()


@pytest.fixture(params=SERVERS)
def server_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each server backend, with a server (and proxy) of the test's own."""
    made = make_harness(request.param, tmp_path)
    yield made
    made.close()


@pytest.fixture(params=BACKENDS)
def shared_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each backend on the session's servers (redis_uri, …): no restart, no partition."""
    uri = None if SCHEMES[request.param].local else request.getfixturevalue(f"{request.param}_uri")
    made = shared_harness_for(request.param, tmp_path, uri)
    yield made
    made.close()


# -- the chaos suite's older names ----------------------------------------------------------------


class PeakSessions:
    """Sample a harness's connection count in a thread; `peak` is the most seen."""

    def __init__(self, rig: Harness, every: float = 0.05) -> None:
        """Start sampling *rig* every *every* seconds."""
        self.peak = self.samples = 0
        self._rig = rig
        self._every = every
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="sessions", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop sampling and return the peak."""
        self._stopping.set()
        self._thread.join(10)
        return self.peak

    def _sample(self) -> None:
        while not self._stopping.wait(self._every):
            self.peak = max(self.peak, self._rig.sessions())
            self.samples += 1


class Rig(Protocol):
    """What `rig` and `server_harness` give: a server of the test's own, a proxy in front."""

    backend: str
    uri: str
    proxied: str
    proxy: Proxy
    server: RedisServer | MariaServer | PostgresServer

    @property
    def kind(self) -> Scheme:
        """The registry's row for this backend."""
        ...  # pragma: no cover

    def restart(self) -> None:
        """Kill the server and start it again."""

    def end_session(self, name: str, slot: int = 0) -> None:
        """Take *name*'s *slot* away from its holder."""

    def partition(self) -> None:
        """Silence the proxy."""

    def sessions(self) -> int:
        """Return how many client connections the server has."""
        ...  # pragma: no cover


@pytest.fixture(params=SERVERS)
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return a fresh server of each kind with a proxy in front (same as `server_harness`)."""
    made = make_harness(request.param, tmp_path)
    yield made
    made.close()


class Target:
    """Where a lock lives, for tests that run on every backend: a URI, and a rig if any."""

    def __init__(self, kind: str, uri: str, rig: Harness | None = None) -> None:
        """Describe the backend *kind* at *uri*."""
        self.kind = kind
        self.uri = uri
        self.rig = rig


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """Return each backend: a private file: directory or abstract namespace, or a rig."""
    made = make_harness(request.param, tmp_path)
    yield Target(made.backend, made.uri, None if made.kind.local else made)
    made.close()


@pytest.fixture
def oracle() -> Iterator[Oracle]:
    """Return an `Oracle`, closed at teardown."""
    witness = Oracle()
    yield witness
    witness.close()


# -- results: each test's numbers, printed together at the end of the run -----------------------

_RESULTS: Final = "PYTEST_LOCKRUN_CHAOS_RESULTS"  # the file the workers append to


def pytest_configure(config: pytest.Config) -> None:
    """In the controlling process, name a fresh file for the workers' results."""
    if not hasattr(config, "workerinput") and _RESULTS not in os.environ:
        handle, path = tempfile.mkstemp(prefix="lockrun-chaos-", suffix=".jsonl")
        os.close(handle)
        os.environ[_RESULTS] = path  # inherited by the xdist workers, started after this
        config.add_cleanup(lambda: os.unlink(path))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the chaos and scale tests measured (margins, peaks, tau)."""
    path = os.environ.get(_RESULTS)
    if not path or not os.path.getsize(path):
        return
    terminalreporter.section("chaos and scale: what was measured")
    with open(path) as results:
        for line in sorted(results):
            entry = json.loads(line)
            numbers = "  ".join(f"{key} {value}" for key, value in entry["numbers"].items())
            terminalreporter.write_line(f"{entry['test']}: {entry['what']}: {numbers}")


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Return a function that keeps a test's measured numbers for the run's summary."""

    def write(what: str, **numbers: object) -> None:
        shown = {
            key: f"{value:.3f}" if isinstance(value, float) else value
            for key, value in numbers.items()
        }
        print(what, shown)
        path = os.environ.get(_RESULTS)
        if path:
            line = json.dumps({"test": request.node.nodeid, "what": what, "numbers": shown})
            with open(path, "a") as results:
                results.write(line + "\n")

    return write
