"""Stand-in servers, SQL probes, certificates and secret checks for contract and backend tests.

The "servers" that are not Redis, MySQL or PostgreSQL are loopback sockets of our own; the
certificates are a throwaway CA's; `secret_free` is the one check that a password never shows.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import psycopg
import pymysql

from lockrun.backends import parse_uri
from lockrun.backends.mysql import lock_key as mysql_key
from lockrun.backends.mysql import parse as mysql_parse
from lockrun.backends.postgres import lock_key as postgres_key
from tests.support.cli import lockrun, one_line
from tests.support.servers import unavailable

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.servers import MariaServer

# Who and where this test process is, as `status` and busy lines name a holder of ours.
ME: Final = pwd.getpwuid(os.geteuid()).pw_name
HOST: Final = os.uname().nodename


def encoded(secret: str) -> str:
    """Return *secret* with ``@ : /`` percent-encoded, as it is written in a URI."""
    return secret.replace("@", "%40").replace(":", "%3A").replace("/", "%2F")


def secret_free(result: subprocess.CompletedProcess[str], *secrets: str) -> None:
    """Assert that none of *secrets* (nor their percent-encodings) was printed anywhere."""
    for secret in secrets:
        for form in {secret, encoded(secret)}:
            assert form not in result.stdout, result.stdout
            assert form not in result.stderr, result.stderr


def assert_refused(uri: str, name: str, status: int, *needles: str) -> None:
    """Assert that a run, a semaphore's wait and status on *uri* exit *status*, one line each.

    The line holds every one of *needles*; nothing runs.
    """
    for args in (
        ("--uri", uri, "-n", name, "--", "echo", "ran"),
        ("--uri", uri, "-n", name, "--slots", "3", "--wait", "5", "--", "echo", "ran"),
        ("status", "--uri", uri, name),
        ("status", "--uri", uri),
    ):
        result = lockrun(*args)
        assert (result.returncode, result.stdout) == (status, ""), args
        line = one_line(result.stderr)
        for needle in needles:
            assert needle in line, line


def timed_lockrun(*args: str, **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run lockrun and return its result and how many seconds it took."""
    began = time.monotonic()
    result = lockrun(*args, timeout=60, **kwargs)
    return result, time.monotonic() - began


def mysql_query(uri: str, sql: str, args: object = None) -> tuple[Any, ...]:
    """Run *sql* on the MySQL server of a lock URI (with its credentials); return every row."""
    connection = pymysql.connect(**mysql_parse(parse_uri(uri)).kwargs, autocommit=True)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, args)
            return tuple(cursor.fetchall())
    finally:
        connection.close()


def create_user(server: MariaServer, user: str, password: str, *grants: str) -> None:
    """Create MariaDB *user* (from anywhere and from localhost) with *password* and *grants*."""
    quoted = password.replace("'", "''")
    for host in ("%", "localhost"):
        statements = [f"CREATE USER '{user}'@'{host}' IDENTIFIED BY '{quoted}'"]
        statements += [f"GRANT {grant} TO '{user}'@'{host}'" for grant in grants]
        server.command("; ".join(statements))


def postgres_query(uri: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Run *sql* on the PostgreSQL server of a lock URI and return every row."""
    with psycopg.connect(uri, autocommit=True) as connection:
        return connection.execute(sql, params or None).fetchall()


def postgres_advisory_locks(uri: str, namespace: str, name: str) -> list[tuple[Any, ...]]:
    """Return (slot or 'gate', granted, pid) of every advisory lock on a name's keys (N ≤ 8)."""
    parts: list[str | int] = [*range(8), "gate"]
    keys = {postgres_key(namespace, name, part): part for part in parts}
    rows = postgres_query(
        uri,
        "SELECT l.classid::bigint << 32 | l.objid::bigint, l.granted, l.pid FROM pg_locks l "
        "WHERE l.locktype = 'advisory' AND l.objsubid = 1 "
        "AND (l.classid::bigint << 32 | l.objid::bigint) = ANY(%s)",
        list(keys),
    )
    return sorted((str(keys[key]), granted, pid) for key, granted, pid in rows)


def mysql_locks(uri: str, namespace: str, name: str) -> list[tuple[str, bool, int]]:
    """Return (slot or 'gate', granted, session) of each GET_LOCK on a name's keys (N ≤ 8)."""
    key = mysql_key(namespace, name)
    parts = [*map(str, range(8)), "gate"]
    locks = [f"{key}:{part}" for part in parts]
    [held] = mysql_query(uri, f"SELECT {', '.join(['IS_USED_LOCK(%s)'] * len(parts))}", locks)
    found = [(part, True, int(id_)) for part, id_ in zip(parts, held, strict=True) if id_]
    waiting = mysql_query(
        uri,
        "SELECT ID, INFO FROM information_schema.PROCESSLIST WHERE INFO LIKE %s",
        (f"SELECT GET_LOCK('{key}:%",),
    )
    for session, info in waiting:
        part = re.match(rf"SELECT GET_LOCK\('{key}:(\w+)'", info)
        assert part is not None, info
        found.append((part[1], False, int(session)))
    return sorted(found)


def server_locks(uri: str, namespace: str, name: str) -> list[tuple[str, bool, int]] | None:
    """Return (slot or 'gate', granted, session) of the server's own locks on a name.

    None for a backend whose locks are no server session's (file:, abstract:, Redis' leases).
    """
    backend = parse_uri(uri).kind.backend
    return SERVER_LOCKS[backend](uri, namespace, name) if backend in SERVER_LOCKS else None


# The backends whose locks are their server sessions' locks, and how to list them.
SERVER_LOCKS: Final[dict[str, Callable[[str, str, str], list[tuple[str, bool, int]]]]] = {
    "mysql": mysql_locks,
    "postgres": postgres_advisory_locks,
}


# A timeout of a driver's own, which lockrun's must come well before: PyMySQL's connect_timeout
# (10 s); redis-py and libpq have none (a hang). A client's wait as a `Listener` saw it is
# judged against this, not against lockrun's timeout plus a start-up a loaded machine misses.
DRIVER_TIMEOUT: Final = 10.0


class Listener:
    """A loopback TCP port of our own that waits for the client to speak first.

    It answers each connection's first message with *reply* and hangs up, or (None) accepts
    and never answers.
    """

    def __init__(self, reply: bytes | None, *, name: str = "not-a-server") -> None:
        """Listen on a free loopback port and serve from a thread until `close`."""
        self.reply = reply
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.05)
        self.port: int = self.server.getsockname()[1]
        self.kept: list[socket.socket] = []  # connections left open, answered or not
        self.silent = self.kept
        # (accepted, hung up by the client), Unix time, of each silent connection: the
        # server's own view of how long a client waited, with no start-up of lockrun's in it.
        self.waited: list[tuple[float, float]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve, name=name, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        """Accept until told to stop, and `handle` each connection."""
        while not self.stopping.is_set():
            try:
                connection, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us
                return
            self.handle(connection)

    def handle(self, connection: socket.socket) -> None:
        """Keep a silent connection open; answer and close others."""
        if self.reply is None:
            self.keep(connection)  # accepted, never answered
            return
        with connection, contextlib.suppress(OSError):
            connection.settimeout(2)
            connection.recv(4096)  # the client's first command, startup or TLS hello
            connection.sendall(self.reply)

    def keep(self, connection: socket.socket) -> None:
        """Keep *connection* open and silent, and note when the client hangs up."""
        self.kept.append(connection)
        accepted = time.time()
        threading.Thread(target=self.drain, args=(connection, accepted), daemon=True).start()

    def drain(self, connection: socket.socket, accepted: float) -> None:
        """Read what the client says (and answer nothing) until it hangs up; note when."""
        with contextlib.suppress(OSError):
            while connection.recv(4096):
                pass
            if not self.stopping.is_set():  # its hang-up, not our close
                self.waited.append((accepted, time.time()))

    def longest_wait(self) -> float:
        """Return how long a client sat silent on us before it hung up, at most (0 for none)."""
        return max((hung_up - accepted for accepted, hung_up in self.waited), default=0.0)

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self.stopping.set()
        self.thread.join(5)
        for connection in self.kept:
            with contextlib.suppress(OSError):  # wakes a `drain` blocked in recv
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self.server.close()


class Greeter(Listener):
    """A loopback TCP port that greets each connection with *greeting* at once, like MySQL.

    A MySQL server speaks first; this one then closes, or keeps the connection and says no
    more (``hang``).
    """

    def __init__(self, greeting: bytes, *, hang: bool = False) -> None:
        """Listen on a free loopback port and serve from a thread until `close`."""
        self.greeting = greeting
        self.hang = hang
        super().__init__(None, name="greeter")

    def handle(self, connection: socket.socket) -> None:
        """Greet, then hang up or keep quiet."""
        with contextlib.suppress(OSError):
            connection.sendall(self.greeting)
        if self.hang:
            self.keep(connection)
        else:
            connection.close()


def make_certificates(directory: Path) -> None:
    """Write a CA, a server and a client certificate signed by it, and an unrelated CA."""
    if shutil.which("openssl") is None:
        unavailable("openssl is not installed")

    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30
        )

    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        openssl(
            *("req", "-x509", *new_key, "-keyout", f"{ca}.key", "-out", f"{ca}.crt"),
            *("-days", "2", "-subj", f"/CN=lockrun test {ca}"),
        )
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for leaf in ("server", "client"):
        openssl(
            "req", *new_key, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}"
        )
        extensions = ("-extfile", "server.ext") if leaf == "server" else ()
        openssl(
            *("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.crt", "-CAkey", "ca.key"),
            *("-CAcreateserial", "-out", f"{leaf}.crt", "-days", "2", *extensions),
        )
