"""Fixtures of the chaos suite: a server of the test's own per backend, with a proxy in front.

Loaded by tests/conftest.py as a plugin (`pytest_plugins`), so that the fixtures reach the
tests under tests/chaos without a second module called ``conftest``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import uuid
from typing import TYPE_CHECKING, Final

import pytest

from tests.support.oracle import Oracle
from tests.support.proxy import Proxy
from tests.support.servers import MariaServer, PostgresServer, RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

SERVERS: Final = ("redis", "mysql", "postgres")
LOCAL: Final = ("file", "abstract")

# How to count a server's client connections, leaving out the one that asks.
_MYSQL_SESSIONS: Final = (
    "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
    " WHERE ID <> CONNECTION_ID() AND COMMAND <> 'Daemon' AND USER <> 'system user'"
)
_POSTGRES_SESSIONS: Final = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


class Rig:
    """A server of one backend on a loopback port, and a `Proxy` in front of it.

    `uri` reaches the server directly, `proxied` through the proxy: lockrun processes on
    either side of a partition.
    """

    def __init__(self, kind: str, *options: str) -> None:
        """Start a *kind* server (with extra *options*) and the proxy."""
        self.kind = kind
        port = free_port()
        self.server: RedisServer | MariaServer | PostgresServer
        if kind == "redis":
            self.server = RedisServer(*options, port=port)
        elif kind == "mysql":
            self.server = MariaServer(*options, port=port)
        else:
            self.server = PostgresServer(*options, port=port)
        self.proxy = Proxy(("127.0.0.1", port))
        self._counter: Callable[[], int] | None = None
        self._closer: Callable[[], object] = lambda: None

    @property
    def uri(self) -> str:
        """The server's own TCP URI."""
        return self.server.tcp_uri

    @property
    def proxied(self) -> str:
        """The same URI through the proxy."""
        return self.uri.replace(f":{self.server.port}/", f":{self.proxy.port}/")

    def restart(self) -> None:
        """Kill the server and start it again (Redis comes back empty)."""
        self._forget_counter()
        self.server.restart()

    def sessions(self) -> int:
        """Return how many client connections the server has now, not counting ours."""
        if self._counter is None:
            self._counter = self._connect_counter()
        return self._counter()

    def close(self) -> None:
        """Stop the proxy and the server."""
        self._forget_counter()
        self.proxy.close()
        self.server.close()

    def _connect_counter(self) -> Callable[[], int]:
        if isinstance(self.server, RedisServer):
            import redis

            client = redis.Redis(unix_socket_path=self.server.socket)
            self._closer = client.close
            return lambda: int(client.info("clients")["connected_clients"]) - 1
        if isinstance(self.server, MariaServer):
            import pymysql

            connection = pymysql.connect(unix_socket=self.server.socket, user="root")
            self._closer = connection.close

            def mysql_count() -> int:
                with connection.cursor() as cursor:
                    cursor.execute(_MYSQL_SESSIONS)
                    (count,) = cursor.fetchone() or (0,)
                return int(count)

            return mysql_count
        import psycopg

        session = psycopg.connect(
            host=self.server.directory,
            port=self.server.port,
            user="lockrun",
            dbname="lockrun",
            autocommit=True,
        )
        self._closer = session.close

        def postgres_count() -> int:
            (count,) = session.execute(_POSTGRES_SESSIONS).fetchone() or (0,)
            return int(count)

        return postgres_count

    def _forget_counter(self) -> None:
        if self._counter is not None:
            with contextlib.suppress(Exception):
                self._closer()
            self._counter = None


class PeakSessions:
    """Sample a rig's connection count in a thread; `peak` is the most seen."""

    def __init__(self, rig: Rig, every: float = 0.05) -> None:
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


@pytest.fixture(params=SERVERS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """Return a fresh server of each kind with a proxy in front, closed at teardown."""
    started = Rig(request.param)
    yield started
    started.close()


class Target:
    """Where a lock lives, for tests that run on every backend: a URI, and a rig if any."""

    def __init__(self, kind: str, uri: str, rig: Rig | None = None) -> None:
        """Describe the backend *kind* at *uri*."""
        self.kind = kind
        self.uri = uri
        self.rig = rig


@pytest.fixture(params=LOCAL + SERVERS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """Return each backend: a private file: directory or abstract namespace, or a rig."""
    kind = request.param
    if kind == "file":
        yield Target(kind, f"file://{tmp_path}/locks")
    elif kind == "abstract":
        yield Target(kind, f"abstract:chaos-{uuid.uuid4().hex[:8]}")
    else:
        started = Rig(kind, *_ROOMY[kind])
        yield Target(kind, started.uri, started)
        started.close()


# Room for 200 waiters and their helpers, the scale test's crowd.
_ROOMY: Final = {
    "redis": ("--maxclients", "2000"),
    "mysql": ("--max-connections=1000",),
    "postgres": ("max_connections=600",),
}


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
