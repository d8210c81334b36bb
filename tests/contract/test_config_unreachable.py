"""Servers that cannot serve a lock, on every server backend: 69 in one line, in bounded time.

Nobody on the port, no socket, no such host, a port that accepts and stays silent, a server
that speaks another protocol, a server with every connection taken. Each scenario runs once
per server backend of the registry; how the backend writes its URI, how long its timeouts
are and the words its driver uses are the per-backend rows of `REACH`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import socket
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import psycopg
import pymysql
import pytest

from lockrun import ExitCode
from lockrun.backends import parse_uri, timeout_for
from lockrun.backends.mysql import parse as mysql_parse
from lockrun.uri import redact
from tests.support.cli import lockrun, one_line, refused_in_process, wait_for
from tests.support.harness import SERVERS
from tests.support.net import (
    DRIVER_TIMEOUT,
    Greeter,
    Listener,
    create_user,
    secret_free,
    timed_lockrun,
)
from tests.support.servers import MariaServer, PostgresServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

SECRET = "S3cr3t-pw"  # noqa: S105 - what the URIs carry, and no line may show
# --ttl 3: Redis gives up a connect or an answer after 0.15 s, MySQL after 1 s, libpq after 2 s.
SHORT_TTL = "3"
# A hang guard for a run that finds nobody there: a Python start-up on a loaded machine and a
# driver's tries, each within the ttl's timeout. Not the timeout's budget: where a server
# accepts, its own clock judges that (Listener.longest_wait against DRIVER_TIMEOUT).
PATIENCE = 30.0
# 256 bytes that look random but are the same in every run.
NOISE = b"".join(hashlib.sha256(bytes([block])).digest() for block in range(8))


class Reach(NamedTuple):
    """How a server backend is reached, and what it says when nobody is there."""

    # The URI of user app (password SECRET) at HOST:PORT.
    tcp: Callable[[str], str]
    # A URI to a socket in a directory where there is none, and what the line names; None
    # where the backend reaches its server on TCP alone (etcd).
    socket: Callable[[Path], tuple[str, str]] | None
    # What the line says of a host that does not resolve.
    no_host: str
    # The connect and answer timeout at --ttl SHORT_TTL.
    timeout: float


REACH: Final = {
    "redis": Reach(
        tcp=lambda where: f"redis://app:{SECRET}@{where}/0",
        socket=lambda directory: (f"unix://{directory}/nothing.sock", "nothing.sock"),
        no_host="nonexistent.invalid",
        timeout=timeout_for(float(SHORT_TTL)),
    ),
    "mysql": Reach(
        tcp=lambda where: f"mysql://root:{SECRET}@{where}/lockrun",
        socket=lambda directory: (
            f"mysql://root@localhost/lockrun?unix_socket={directory}/nothing.sock",
            "nothing.sock",
        ),
        no_host="nonexistent.invalid",
        timeout=timeout_for(float(SHORT_TTL), durable=True),
    ),
    "postgres": Reach(
        tcp=lambda where: f"postgresql://app:{SECRET}@{where}/lockrun",
        socket=lambda directory: (
            f"postgresql://app:{SECRET}@/lockrun?host={directory}&port=5999",
            f"{directory}/.s.PGSQL.5999",
        ),
        no_host="resolve",
        timeout=max(
            2, math.ceil(timeout_for(float(SHORT_TTL), durable=True))
        ),  # libpq's least is 2 s
    ),
    "etcd": Reach(
        tcp=lambda where: f"etcd://app:{SECRET}@{where}",
        socket=None,
        no_host="nonexistent.invalid",
        timeout=timeout_for(float(SHORT_TTL), durable=True),
    ),
}
# The ways to run into the server: a run, a verbose wait (whose first call asks who holds
# the lock, and must keep the timeouts of --ttl all the same), and status.
ATTEMPTS: Final = {
    "run": ("--ttl", SHORT_TTL),
    # An hour's wait: one that waited it out would fail timed_lockrun's 60 s, so 69 within
    # it is "at once", however loaded the machine.
    "verbose-wait": ("-v", "--wait", "3600", "--ttl", SHORT_TTL),
}


def attempt(how: str, uri: str, name: str) -> tuple[tuple[str, ...], bool]:
    """Return lockrun's arguments for *how*, and whether they name the lock in the line."""
    if how == "status":
        return ("status", "--uri", uri, name), False
    return (*ATTEMPTS[how], "--uri", uri, "-n", name, "--", "echo", "ran"), True


def check_unavailable(
    how: str,
    uri: str,
    name: str,
    needle: str,
    *,
    secrets: tuple[str, ...] = (),
    capfd: pytest.CaptureFixture[str] | None = None,
) -> str:
    """Run lockrun the *how* way: 69, one line naming the server and *needle*, in time.

    With *capfd*, in this process (`refused_in_process`): for a sweep of what a driver reads.
    """
    args, named = attempt(how, uri, name)
    if capfd is None:
        result, elapsed = timed_lockrun(*args)
    else:
        began = time.monotonic()
        result = refused_in_process(capfd, *args)
        elapsed = time.monotonic() - began
    assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, ""), result.stderr
    line = one_line(result.stderr)
    prefix = f"lockrun: {name}: " if named else "lockrun: "
    assert line.startswith(f"{prefix}{redact(uri)}"), line
    assert re.search(needle, line, re.IGNORECASE), line
    assert "internal error" not in line
    secret_free(result, SECRET, *secrets)
    assert elapsed < PATIENCE
    return line


@pytest.fixture(params=SERVERS)
def reach(request: pytest.FixtureRequest) -> Reach:
    """Return each server backend's `Reach`."""
    return REACH[request.param]


@pytest.mark.parametrize(
    ("where", "needle", "how"),
    [
        ("127.0.0.1:{port}", "Connection refused", "run"),
        ("127.0.0.1:{port}", "Connection refused", "verbose-wait"),
        ("127.0.0.1:{port}", "Connection refused", "status"),
        # Without IPv6 in the container, [::1] cannot even be tried.
        ("[::1]:{port}", "refused|cannot assign|unreachable", "run"),
        ("localhost:{port}", "refused|cannot assign|unreachable", "run"),
    ],
    ids=["ipv4", "ipv4-verbose-wait", "ipv4-status", "ipv6", "name"],
)
def test_a_refused_connection_exits_69_quickly(
    reach: Reach, where: str, needle: str, how: str, name: str
) -> None:
    """Nobody on the port: 69 with one line naming the server, well within the timeout."""
    uri = reach.tcp(where.format(port=free_port()))
    check_unavailable(how, uri, name, needle)


@pytest.mark.parametrize("how", ["run", "verbose-wait", "status"])
def test_a_missing_socket_or_host_exits_69(
    reach: Reach, how: str, tmp_path: Path, name: str
) -> None:
    """A unix socket that does not exist and a host that does not resolve: 69, one line."""
    if reach.socket is not None:
        uri, needle = reach.socket(tmp_path)
        check_unavailable(how, uri, name, re.escape(needle))
    uri = reach.tcp("nonexistent.invalid")
    check_unavailable(how, uri, name, re.escape(reach.no_host))


@pytest.mark.parametrize("how", ["run", "verbose-wait", "status"])
@pytest.mark.parametrize("accepts", [True, False], ids=["accepts", "backlog"])
def test_a_server_that_never_answers_exits_69_within_the_ttls_timeout(
    reach: Reach, accepts: bool, how: str, name: str
) -> None:
    """A port that never answers costs one timeout of the ttl's (not a hang), whoever asks.

    It accepts and says nothing, or never even accepts (the kernel's backlog).
    """
    with contextlib.ExitStack() as stack:
        if accepts:
            listener = stack.enter_context(contextlib.closing(Listener(None)))
            port = listener.port
        else:
            silent = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=16))
            port = silent.getsockname()[1]
        uri = reach.tcp(f"127.0.0.1:{port}")
        # status has no --ttl: its timeouts are the default ttl's.
        within = "" if how == "status" else f"{reach.timeout:g}s"
        line = check_unavailable(how, uri, name, f"no answer within {within}")
        if accepts:
            wait_for(lambda: listener.waited, what="lockrun to hang up")
            # Accept to hang-up on the server's clock, no start-up in it: lockrun's timeout.
            assert listener.longest_wait() < DRIVER_TIMEOUT
    assert f"127.0.0.1:{port}" in line


REPLIES: Final = {
    "http": (b"HTTP/1.1 400 Bad Request\r\n\r\n", False),
    "ssh": (b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n", True),
    "binary-garbage": (b"\x00\xff\x13garbage garbage\r\n" * 8, False),
    "random-bytes": (NOISE, False),
    "redis-like": (b"-ERR unknown command\r\n", False),
    "hang-up": (b"", False),
}
# What the line says beyond the server's address, where a backend's driver says it for sure
# (a server that waits for the client, to a MySQL client that waits for the server: silence).
NOT_POSTGRES: Final = "does not answer like a PostgreSQL server"
SAYS: Final = {
    ("mysql", "http", "greets"): "does not answer like",
    ("mysql", "ssh", "greets"): "does not answer like",
    ("mysql", "binary-garbage", "greets"): "does not answer like",
    ("mysql", "hang-up", "greets"): "Lost connection",
    ("mysql", "redis-like", "replies"): "no answer within 1s",
    ("mysql", "http", "replies"): "no answer within 1s",
    ("postgres", "http", "replies"): NOT_POSTGRES,
    ("postgres", "binary-garbage", "replies"): NOT_POSTGRES,
    ("postgres", "redis-like", "replies"): NOT_POSTGRES,
    ("postgres", "hang-up", "replies"): "server closed the connection unexpectedly",
    ("postgres", "http", "replies-to-status"): NOT_POSTGRES,
    ("postgres", "binary-garbage", "replies-to-status"): NOT_POSTGRES,
    ("postgres", "redis-like", "replies-to-status"): NOT_POSTGRES,
    ("postgres", "hang-up", "replies-to-status"): "server closed the connection unexpectedly",
}


# The replies only feed the drivers' parsers and lockrun's reading of their errors. Those to
# `lockrun status` run the CLI in this process (what `lockrun` does past its start-up); a
# run's stay processes: a run forks its guardian before it connects (refused_in_process).
@pytest.mark.parametrize("mode", ["greets", "replies", "replies-to-status"])
@pytest.mark.parametrize("reply", list(REPLIES))
# etcd's gateway meets hostile HTTP in tests/backends/test_etcd.py (eight impostors), which
# this sweep of other protocols would repeat at a CI minute's cost.
@pytest.mark.parametrize("backend", [backend for backend in SERVERS if backend != "etcd"])
def test_a_server_of_another_protocol_exits_69(
    backend: str, reply: str, mode: str, name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """HTTP, SSH, garbage, Redis's words or a hang-up on the port: 69, one line, quickly.

    The bytes come at once (a server that speaks first, like MySQL) or as the reply to what
    the client says first (like Redis and PostgreSQL).
    """
    in_process = capfd if mode == "replies-to-status" else None
    meet_another_protocol(backend, reply, mode, name, in_process)


def meet_another_protocol(
    backend: str,
    reply: str,
    mode: str,
    name: str,
    capfd: pytest.CaptureFixture[str] | None = None,
) -> None:
    """Run lockrun against a stand-in of *backend* that says *reply* the *mode* way: 69."""
    data, hang = REPLIES[reply]
    reach = REACH[backend]
    stand_in = Greeter(data, hang=hang) if mode == "greets" else Listener(data)
    with contextlib.closing(stand_in):
        uri = reach.tcp(f"127.0.0.1:{stand_in.port}")
        how = "status" if mode == "replies-to-status" else "run"
        line = check_unavailable(how, uri, name, "", capfd=capfd)
    assert f"127.0.0.1:{stand_in.port}" in line
    assert SAYS.get((backend, reply, mode), "") in line


def mysql_full(name: str) -> tuple[Any, list[str], list[Any]]:
    """Return a MariaDB with every connection taken, lockrun's URIs to it, and the takers.

    MariaDB's smallest max_connections is 10, and it lets SUPER users in beyond it: the
    connections are taken, and lockrun connects, as a user without privileges.
    """
    server = MariaServer("--max-connections=10", port=free_port())
    create_user(server, "app", "pw-app", "ALL ON lockrun.*")
    uri = f"mysql://app:pw-app@127.0.0.1:{server.port}/lockrun"
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0
    taken: list[Any] = []
    app = mysql_parse(parse_uri(uri)).kwargs
    with pytest.raises(pymysql.err.OperationalError, match="Too many"):  # noqa: PT012
        while len(taken) < 20:  # fill up
            taken.append(pymysql.connect(**app))
    return server, [uri, server.uri.replace("root@", "app:pw-app@")], taken


def postgres_full(name: str) -> tuple[Any, list[str], list[Any]]:
    """Return a PostgreSQL with all 3 connections taken (none reserved), URIs, and takers."""
    server = PostgresServer(
        "max_connections=3", "superuser_reserved_connections=0", port=free_port()
    )
    assert lockrun("--uri", server.tcp_uri, "-n", name, "--", "true").returncode == 0
    taken: list[Any] = []
    deadline = time.monotonic() + 30  # a hang guard
    try:
        while len(taken) < 3:
            try:
                taken.append(psycopg.connect(server.tcp_uri))
            except psycopg.OperationalError as err:
                # lockrun's backend may still be leaving (seen under load: two taken)
                if "too many clients" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with pytest.raises(psycopg.OperationalError, match="too many clients"):
            psycopg.connect(server.tcp_uri)
    except BaseException:
        for connection in taken:
            connection.close()
        server.close()
        raise
    return server, [server.tcp_uri, server.uri], taken


# A server of each backend whose connections can all be taken, and what its refusal says.
FULL: Final = {
    "mysql": (mysql_full, ("max_connections",)),
    "postgres": (postgres_full, ("max_connections", "too many clients")),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(FULL))
def test_a_full_server_exits_69_naming_max_connections(backend: str, name: str) -> None:
    """With every connection taken, runs (TCP, socket), a semaphore's wait and status exit 69."""
    fill, needles = FULL[backend]
    server, (tcp, local), taken = fill(name)
    try:
        for args in (
            ("--ttl", SHORT_TTL, "--uri", tcp, "-n", name, "--", "echo", "ran"),
            ("--ttl", SHORT_TTL, "--uri", local, "-n", name, "--", "echo", "ran"),
            ("--ttl", SHORT_TTL, "--uri", local, "-n", name, "-s", "2", "-w", "5", "--", "true"),
            ("status", "--uri", tcp, name),
        ):
            result = lockrun(*args)
            assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, ""), args
            line = one_line(result.stderr)
            assert all(needle in line for needle in needles), line
            secret_free(result, "pw-app")
        taken.pop().close()
        wait_for(
            lambda: lockrun("--uri", tcp, "-n", name, "--", "true").returncode == 0,
            timeout=10,
            what="a free connection",
        )
    finally:
        for connection in taken:
            connection.close()
        server.close()
