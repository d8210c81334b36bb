"""What only PostgreSQL does: keys, libpq URIs, pg_locks, poolers, standbys, psycopg, sessions.

What every backend shares (status, passwords, unreachable servers, bad URIs, --slots
mismatches) is in tests/contract. Every server here is a real PostgreSQL (the session's, one
of this module's, or a test's own); the poolers are real PgBouncers in front of one.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from lockrun import ConfigError, ExitCode, Lock
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.postgres import lock_key, parse, slots_key
from lockrun.backends.postgres.keys import application_name, halves
from lockrun.errors import LeaseLost
from lockrun.uri import redact
from tests.support.cli import finish, lockrun, one_line, queue_length, wait_for
from tests.support.net import assert_refused, secret_free
from tests.support.net import postgres_advisory_locks as advisory_locks
from tests.support.net import postgres_query as query
from tests.support.servers import (
    PostgresServer,
    _Server,
    free_port,
    postgres_bin,
    postgres_user,
    unavailable,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from subprocess import Popen

    from tests.support.cli import Held

SECRET = "S3cr3t-pw"  # noqa: S105 - the throwaway servers' password that must never show
PGBOUNCER = "/usr/sbin/pgbouncer"


def _readme_query() -> str:
    """Return docs/backends.md's ready psql query that lists lockrun's holders, as printed."""
    text = (Path(__file__).parent.parent.parent / "docs" / "backends.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", text, re.DOTALL)
    found = [block for block in blocks if block.startswith("SELECT a.application_name")]
    assert len(found) == 1, "the documented holder query is missing"
    return str(found[0]).strip().rstrip(";")


README_QUERY = _readme_query()
SERVER_KEY = (
    r"SELECT ('x' || left(encode(sha256(convert_to(%s, 'UTF8') || '\x00'::bytea "
    r"|| convert_to(%s, 'UTF8') || '\x00'::bytea || convert_to(part, 'UTF8')), 'hex'), "
    r"16))::bit(64)::bigint FROM unnest(%s::text[]) WITH ORDINALITY AS parts(part, n) ORDER BY n"
)
SERVER_SLOTS_KEY = (
    r"SELECT ('x' || left(encode(sha256(convert_to(%s, 'UTF8') || '\x00'::bytea "
    r"|| convert_to(%s, 'UTF8')), 'hex'), 8))::bit(32)::int"
)
NAMES = [
    ("default", "x"),
    ("default", "nightly-etl"),
    ("ns/with space", "a:b*c%d'e\"f\\g"),
    ("default", "Ünïcødé ✓ 名前"),
    ("émoji", "🔒 lock 🔑"),
    ("default", "y" * 255),
    ("default", "ü" * 127 + "z"),  # 255 bytes of UTF-8
]


@pytest.fixture(scope="module")
def auth_server() -> Iterator[PostgresServer]:
    """Return a PostgreSQL with a loopback port and password roles, shared by this module."""
    # app (SECRET) may connect to lockrun; noconn lacks CONNECT on it; nolog may not log in.
    server = PostgresServer(port=free_port())
    try:
        server.command(f"CREATE ROLE app LOGIN PASSWORD '{SECRET}'")
        server.command("CREATE ROLE noconn LOGIN PASSWORD 'pw-noconn'")
        server.command("CREATE ROLE nolog PASSWORD 'pw-x9q'")
        server.command("REVOKE CONNECT ON DATABASE lockrun FROM PUBLIC")
        server.command("GRANT CONNECT ON DATABASE lockrun TO app")
    except BaseException:
        server.close()
        raise
    yield server
    server.close()


@pytest.fixture
def no_pg_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep the developer's PG* settings and ~/.pgpass out of the tests."""
    for variable in list(os.environ):
        if variable.startswith("PG"):
            monkeypatch.delenv(variable)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-pgpass"))


# -- A. lock keys, URIs and session names, in process ----------------------------------------------


@pytest.mark.parametrize(("namespace", "name"), NAMES)
def test_lock_key_and_slots_key_are_what_the_server_computes(
    postgres_uri: str, namespace: str, name: str
) -> None:
    """lock_key() equals the documented SQL for slots 0, 1, 2, 63 and the gate.

    slots_key() equals the int4 form of the same SQL (first 4 bytes of namespace NUL name).
    """
    parts: list[str | int] = [0, 1, 2, 63, "gate"]
    keys = [lock_key(namespace, name, part) for part in parts]
    rows = query(postgres_uri, SERVER_KEY, namespace, name, [str(part) for part in parts])
    assert [row[0] for row in rows] == keys
    assert all(-(2**63) <= key < 2**63 for key in keys)
    assert len(set(keys)) == len(keys)
    key = slots_key(namespace, name)
    assert -(2**31) <= key < 2**31
    assert query(postgres_uri, SERVER_SLOTS_KEY, namespace, name) == [(key,)]


def test_keys_are_signed_and_differ_between_namespaces() -> None:
    """Keys use the whole signed 64-bit range; another namespace or part gives another key."""
    keys = {lock_key("default", f"name-{index}", 0) for index in range(64)}
    assert min(keys) < 0 < max(keys)
    for name in ("x", "nightly-etl", "🔒"):
        by_namespace = {lock_key(namespace, name, 0) for namespace in ("a", "b", "default", "")}
        assert len(by_namespace) == 4
        assert lock_key("a", name, 0) != lock_key("a", name, "gate")
        assert slots_key("a", name) != slots_key("b", name)
    # NUL separates the parts: moving text between namespace and name changes the key.
    assert lock_key("ab", "c", 0) != lock_key("a", "bc", 0)
    assert halves(-1) == (0xFFFF_FFFF, 0xFFFF_FFFF)
    assert halves(lock_key("a", "x", 0)) == (
        (lock_key("a", "x", 0) & 0xFFFF_FFFF_FFFF_FFFF) >> 32,
        lock_key("a", "x", 0) & 0xFFFF_FFFF,
    )


# libpq URIs, what messages show of them, and what libpq reads from them.
LIBPQ_URIS = {
    "socket-dir": (
        "postgresql://lockrun@/lockrun?host=/tmp/pg&port=5433",
        "postgresql://***@/lockrun?host=/tmp/pg&port=5433",
        {"user": "lockrun", "dbname": "lockrun", "host": "/tmp/pg", "port": "5433"},
    ),
    "postgres-scheme-socket": (
        "postgres:///app?host=/run/postgresql",
        "postgres:///app?host=/run/postgresql",
        {"dbname": "app", "host": "/run/postgresql"},
    ),
    "encoded-socket-host": (
        "postgresql://%2Frun%2Fpostgresql/app",
        "postgresql://%2Frun%2Fpostgresql/app",
        {"dbname": "app", "host": "/run/postgresql"},
    ),
    "password": (
        f"postgres://u:{SECRET}@db.internal:5433/app?sslmode=require",
        "postgres://***@db.internal:5433/app?sslmode=require",
        {"user": "u", "password": SECRET, "host": "db.internal", "port": "5433"},
    ),
    "password-in-query": (
        f"postgresql://u@/app?host=/var/run/pg&password={SECRET}",
        "postgresql://***@/app?host=/var/run/pg&password=***",
        {"user": "u", "password": SECRET, "host": "/var/run/pg"},
    ),
    "encoded-password": (
        "postgresql://u:p%40ss%3Aw%2Frd@h/app",
        "postgresql://***@h/app",
        {"user": "u", "password": "p@ss:w/rd", "host": "h"},
    ),
    "multi-host": (
        "postgresql://h1:5432,h2:5433/app?target_session_attrs=read-write",
        "postgresql://h1:5432,h2:5433/app?target_session_attrs=read-write",
        {"host": "h1,h2", "port": "5432,5433", "target_session_attrs": "read-write"},
    ),
    "ipv6": (
        "postgresql://[::1]:5432/app",
        "postgresql://[::1]:5432/app",
        {"host": "::1", "port": "5432", "dbname": "app"},
    ),
    "bare": ("postgresql://", "postgresql://", {}),
}


@pytest.mark.parametrize(("text", "where", "expected"), LIBPQ_URIS.values(), ids=LIBPQ_URIS)
def test_parse_accepts_libpq_uris(text: str, where: str, expected: dict[str, str]) -> None:
    """postgresql:// and postgres:// URIs reach libpq as they are; messages name no password."""
    settings = parse(parse_uri(text))
    assert settings.conninfo == text
    assert settings.where == where
    assert SECRET not in settings.where
    parsed = psycopg.conninfo.conninfo_to_dict(settings.conninfo)
    assert {key: parsed.get(key) for key in expected} == expected
    if "password" in expected:
        assert expected["password"] in settings.secrets.passwords
    else:
        assert settings.secrets.passwords == ()


@pytest.mark.parametrize(
    ("text", "needle", "hidden"),
    [
        (f"postgresql://app:{SECRET}@h/db?foo=1", 'invalid URI query parameter: "foo"', SECRET),
        ("postgresql://app:p@ss%zz@h/db", "invalid percent-encoded token", "p@ss%zz"),
        (f"postgresql://app:{SECRET}%zz@h/db", "invalid percent-encoded token", SECRET),
        (f"postgresql://app:%zz{SECRET}@h/db", "invalid percent-encoded token", SECRET),
        (f"postgresql://app@h/db?password={SECRET}%zz", "invalid percent-encoded token", SECRET),
        (f"postgresql://app:{SECRET}@[::1/db", 'matching "]"', SECRET),
        (f"postgresql://app:{SECRET} x@h/db", "unexpected spaces", SECRET),
    ],
    ids=[
        "unknown-parameter",
        "partly-bad-password",
        "bad-escape-after",
        "bad-escape-before",
        "bad-password-parameter",
        "unclosed-ipv6",
        "space",
    ],
)
def test_parse_refuses_malformed_uris_without_the_password(
    text: str, needle: str, hidden: str
) -> None:
    """The parser of libpq refuses them: ConfigError (78) naming no piece of the password."""
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(text))
    message = str(raised.value)
    assert "not a libpq connection URI" in message
    assert needle in message
    assert "\n" not in message
    for piece in {hidden, hidden[:4], hidden[-4:], "ss%zz"}:
        assert piece not in message, message


def test_parse_hides_a_password_holding_a_double_quote() -> None:
    """A malformed URI whose password has a '"' still names no part of the password."""
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(f'postgresql://app:pa"{SECRET}%zz@h/db'))
    assert SECRET not in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    ("name", "slot"),
    [
        ("plain", 0),
        ("n" * 255, 2),
        ("ü" * 100, 0),
        ("🔒" * 30, 12),
        ("a" + "🔒" * 30, 0),
        ("名前" * 40, 63),
    ],
    ids=["ascii", "long-ascii", "umlauts", "emoji", "emoji-offset", "cjk"],
)
def test_application_name_fits_63_bytes_at_a_character_boundary(name: str, slot: int) -> None:
    """lockrun:NAME:SLOT keeps the longest prefix of NAME that fits 63 bytes, whole characters."""
    application = application_name(name, slot)
    raw = application.encode()
    assert len(raw) <= 63
    assert application.startswith("lockrun:")
    assert application.endswith(f":{slot}")
    kept = application.removeprefix("lockrun:").removesuffix(f":{slot}")
    assert name.startswith(kept)
    if kept != name:
        longer = f"lockrun:{name[: len(kept) + 1]}:{slot}"
        assert len(longer.encode()) > 63
    if len(name.encode()) + len(f"lockrun::{slot}") <= 63:
        assert kept == name


# -- B. what an operator sees on the server --------------------------------------------------------


def test_a_holder_shows_in_pg_locks_under_its_application_name(
    postgres_uri: str, held: Callable[..., Held], name: str
) -> None:
    """The slot-0 key (classid, objid, objsubid 1) and the (hash, N) lock; the README query."""
    key = lock_key("default", name, 0)
    classid, objid = halves(key)
    holder = held("--uri", postgres_uri, "-n", name)
    assert holder.slot == 0
    rows = query(
        postgres_uri,
        "SELECT l.classid::bigint, l.objid::bigint, l.objsubid, l.mode, a.application_name, "
        "a.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
        "AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid",
        classid,
        objid,
    )
    assert [row[:5] for row in rows] == [(classid, objid, 1, "ExclusiveLock", f"lockrun:{name}:0")]
    pid = rows[0][5]
    # Every holder also holds (hash32(namespace NUL name), N) shared, on the same session.
    shared = query(
        postgres_uri,
        "SELECT l.objid::bigint, l.mode, l.pid FROM pg_locks l WHERE l.locktype = 'advisory' "
        "AND l.granted AND l.objsubid = 2 AND l.classid = (%s::bigint & 4294967295)::oid",
        slots_key("default", name),
    )
    assert shared == [(1, "ShareLock", pid)]

    readme = query(postgres_uri, README_QUERY)
    mine = [row for row in readme if row[0] == f"lockrun:{name}:0"]
    assert key in {row[3] for row in mine}, readme
    for application, client, started, _ in mine:
        assert application == f"lockrun:{name}:0"
        assert client is None  # the session's URI is a unix socket
        assert isinstance(started, dt.datetime)
        assert started <= dt.datetime.now(dt.UTC)

    assert holder.finish() == 0
    assert advisory_locks(postgres_uri, "default", name) == []
    assert not [row for row in query(postgres_uri, README_QUERY) if name in row[0]]


@pytest.mark.parametrize("tail", ["n" * 240, "ü" * 120], ids=["ascii", "non-ascii"])
def test_a_long_name_is_cut_to_the_application_name_postgres_keeps(
    postgres_uri: str, held: Callable[..., Held], name: str, tail: str
) -> None:
    """A name of 250+ bytes: the session's application_name is lockrun:PREFIX:0, 63 bytes."""
    long_name = f"{name}{tail}"
    expected = application_name(long_name, 0)
    holder = held("--uri", postgres_uri, "-n", long_name)
    readme = query(postgres_uri, README_QUERY)
    [application] = {row[0] for row in readme if row[3] == lock_key("default", long_name, 0)}
    assert len(application.encode()) <= 63
    assert application.startswith(f"lockrun:{name}")
    assert application.endswith(":0")
    if tail.isascii():
        assert application == expected
        assert len(application) == 63
    else:  # PostgreSQL keeps only ASCII there: other bytes become ? (15) or \xNN (16+)
        assert "?" in application or "\\x" in application
    assert holder.finish() == 0


def test_a_tcp_holder_shows_its_client_address_in_the_readme_query(
    auth_server: PostgresServer, held: Callable[..., Held], name: str
) -> None:
    """Over TCP the README query names 127.0.0.1 and the key of the held slot."""
    holder = held("--uri", auth_server.tcp_uri, "-n", name)
    readme = query(auth_server.uri, README_QUERY)
    mine = [row for row in readme if row[0] == f"lockrun:{name}:0"]
    assert lock_key("default", name, 0) in {row[3] for row in mine}
    assert {str(row[1]) for row in mine} == {"127.0.0.1"}
    assert holder.finish() == 0


# -- C. fences: in tests/backends/test_postgres_fences.py ------------------------------------


# -- D. passwords from libpq's environment, option values libpq refuses ----------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("no_pg_environment")
def test_pgpassword_and_a_pgpass_file_supply_the_password(
    auth_server: PostgresServer, tmp_path: Path, name: str
) -> None:
    """PGPASSWORD and PGPASSFILE reach libpq: exit 0, over TCP and the socket; none printed."""
    tcp = f"postgresql://app@127.0.0.1:{auth_server.port}/lockrun"
    local = f"postgresql://app@/lockrun?host={auth_server.directory}&port={auth_server.port}"
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(
        f"127.0.0.1:{auth_server.port}:lockrun:app:{SECRET}\n"
        f"{auth_server.directory}:{auth_server.port}:lockrun:app:{SECRET}\n"
    )
    pgpass.chmod(0o600)
    fence = ("--", "sh", "-c", "echo $LOCKRUN_FENCE")
    for environment in ({"PGPASSWORD": SECRET}, {"PGPASSFILE": str(pgpass)}):
        for uri in (tcp, local):
            env = {**os.environ, **environment}
            result = lockrun("-v", "--uri", uri, "-n", name, *fence, env=env)
            assert result.returncode == 0, (environment, uri, result.stderr)
            assert int(result.stdout) > 0
            secret_free(result, SECRET)
            status = lockrun("status", "--uri", uri, "--json", env=env)
            assert status.returncode == 0, status.stderr
            secret_free(status, SECRET)
    wrong = lockrun("--uri", tcp, "-n", name, "--", "true", env={**os.environ, "PGPASSWORD": "x1"})
    assert wrong.returncode == ExitCode.UNAVAILABLE
    assert "authentication failed" in one_line(wrong.stderr)


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ("sslmode=bogus", 'invalid sslmode value: "bogus"'),
        ("target_session_attrs=bogus", "invalid target_session_attrs value"),
        ("port=abc", 'invalid integer value "abc"'),
    ],
)
def test_an_invalid_option_value_exits_78(
    auth_server: PostgresServer, option: str, needle: str, name: str
) -> None:
    """An option value libpq refuses is a bad URI (78, docs/design.md), not a server down."""
    uri = f"postgresql://lockrun@127.0.0.1:{auth_server.port}/lockrun?{option}"
    result = lockrun("--uri", uri, "-n", name, "--", "echo", "ran")
    assert needle in one_line(result.stderr)
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, "")


# -- E. psycopg missing ----------------------------------------------------------------------------


def run_without(
    hidden: Sequence[str], *args: str, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run lockrun ARGS in a Python where the modules *hidden* cannot be imported."""
    script = (
        "import runpy, sys\n"
        f"for module in {list(hidden)!r}:\n"
        "    sys.modules[module] = None\n"
        f"sys.argv = {['lockrun', *args]!r}\n"
        "runpy.run_module('lockrun', run_name='__main__')\n"
    )
    command = [sys.executable, "-c", script]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, check=False, **kwargs
    )


def test_a_missing_psycopg_exits_78_with_the_pip_command(tmp_path: Path, name: str) -> None:
    """No psycopg module at all, or one without libpq: 78, one line, the pip extra to install.

    Without psycopg_c, psycopg_binary and a loadable libpq too: still one line (docs/design.md).
    """
    uri = f"postgresql://lockrun@127.0.0.1:{free_port()}/lockrun"
    args = ("--uri", uri, "-n", name, "--", "echo", "ran")
    fake = tmp_path / "fake" / "psycopg"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("no pq wrapper available")\n')
    path = os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))
    shadowed = {**os.environ, "PYTHONPATH": path}
    no_libpq = ["psycopg_c", "psycopg_binary", "psycopg.pq.pq_ctypes"]
    for result, needle in (
        (run_without(["psycopg"], *args), "postgresql: needs the psycopg module"),
        (run_without(["psycopg"], "status", "--uri", uri), "postgresql: needs the psycopg module"),
        (
            lockrun(*args, env={**os.environ, "PSYCOPG_IMPL": "c"}),
            "postgresql: needs couldn't import requested psycopg 'c' implementation",
        ),
        (lockrun(*args, env=shadowed), "postgresql: needs no pq wrapper available"),
        (
            lockrun("status", "--uri", f"postgres://h:{free_port()}/db", env=shadowed),
            "postgres: needs no pq wrapper available",
        ),
        (run_without(no_libpq, *args), "postgresql: needs no pq wrapper available"),
    ):
        assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
        line = one_line(result.stderr)
        assert line.startswith(f"lockrun: {needle}")
        assert line.endswith("pip install 'lockrun-cli[postgres]'")


# -- F. PgBouncer ----------------------------------------------------------------------------------


class Bouncer(_Server):
    """A PgBouncer of our own in front of *server*, on a loopback port and a socket."""

    LOG = "pgbouncer.log"

    def __init__(self, server: PostgresServer, pool_mode: str, *settings: str) -> None:
        """Write its configuration, start it (as postgres when we are root), wait for it."""
        if not os.path.exists(PGBOUNCER):
            unavailable(f"{PGBOUNCER} is not installed")
        self.directory = tempfile.mkdtemp(prefix="lr-bouncer-")
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.config = os.path.join(self.directory, "pgbouncer.ini")
        with open(self.config, "w") as ini:
            ini.write(
                "[databases]\n"
                f"* = host={server.directory} port={server.port} user=lockrun\n"
                "[pgbouncer]\n"
                "listen_addr = 127.0.0.1\n"
                f"listen_port = {self.port}\n"
                f"unix_socket_dir = {self.directory}\n"
                "auth_type = any\n"
                f"pool_mode = {pool_mode}\n"
                f"logfile = {self.directory}/{self.LOG}\n"
                f"pidfile = {self.directory}/pgbouncer.pid\n"
                + "".join(f"{setting}\n" for setting in settings)
            )
        self.start()

    @property
    def uri(self) -> str:
        """The lock URI of the pooler's loopback port, database ``lockrun``."""
        return f"postgresql://lockrun@127.0.0.1:{self.port}/lockrun"

    def start(self) -> None:
        """Start the pooler and wait until it accepts TCP connections."""
        self._launch([PGBOUNCER, self.config], patience=30, pause=0.02, user=postgres_user())

    def ping(self) -> bool:
        """Return whether the pooler accepts TCP connections."""
        with socket.socket() as probe:
            probe.settimeout(1)
            return probe.connect_ex(("127.0.0.1", self.port)) == 0


@pytest.fixture
def bouncer(auth_server: PostgresServer) -> Iterator[Callable[..., Bouncer]]:
    """Return a factory of PgBouncers in front of the module's server, stopped at teardown."""
    started: list[Bouncer] = []

    def factory(pool_mode: str, *settings: str) -> Bouncer:
        pooler = Bouncer(auth_server, pool_mode, *settings)
        started.append(pooler)
        return pooler

    yield factory
    for pooler in started:
        pooler.close()


@pytest.mark.parametrize("pool_mode", ["transaction", "statement"])
def test_a_pooler_in_transaction_or_statement_mode_exits_78(
    bouncer: Callable[..., Bouncer], pool_mode: str, name: str
) -> None:
    """Session advisory locks do not survive transaction or statement pooling: 78, one line."""
    pooler = bouncer(pool_mode)
    needle = "connection pooler in transaction or statement mode"
    assert_refused(pooler.uri, name, ExitCode.CONFIG, needle, redact(pooler.uri))


def test_a_pooler_in_session_mode_holds_locks(
    bouncer: Callable[..., Bouncer],
    auth_server: PostgresServer,
    held: Callable[..., Held],
    name: str,
) -> None:
    """Session pooling gives each client its own server session: runs (0), excludes (75)."""
    pooler = bouncer("session")
    result = lockrun("-v", "--uri", pooler.uri, "-n", name, "--", "printenv", "LOCKRUN_FENCE")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0
    assert "a pooler in session mode" in result.stderr
    holder = held("--uri", pooler.uri, "-n", name)
    for uri in (pooler.uri, auth_server.tcp_uri):  # through the pooler, and straight to the server
        busy = lockrun("--uri", uri, "-n", name, "--", "echo", "ran")
        assert (busy.returncode, busy.stdout) == (ExitCode.BUSY, ""), busy.stderr
        assert f"pid {holder.process.pid}" in one_line(busy.stderr)
    [state] = json.loads(lockrun("status", "--uri", pooler.uri, "--json", name).stdout)
    assert [owner["pid"] for owner in state["holders"]] == [holder.process.pid]
    assert holder.finish() == 0
    again = lockrun("--uri", pooler.uri, "-n", name, "--", "echo", "ran")
    assert (again.returncode, again.stdout) == (0, "ran\n"), again.stderr


def test_transaction_pooling_with_round_robin_is_refused(
    bouncer: Callable[..., Bouncer], name: str
) -> None:
    """Transaction pooling is refused (78) however PgBouncer hands out its server sessions."""
    pooler = bouncer("transaction", "server_round_robin = 1")
    clients = [psycopg.connect(pooler.uri) for _ in range(2)]
    try:  # two transactions at once: the pool keeps two idle server sessions
        for client in clients:
            client.execute("SELECT 1")
    finally:
        for client in clients:
            client.commit()
            client.close()
    result = lockrun("--uri", pooler.uri, "-n", name, "--", "echo", "ran")
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr


# -- G. a standby ----------------------------------------------------------------------------------


def _commits(uri: str) -> int:
    """Return how many transactions the server has committed in the lock's database."""
    [(count,)] = query(
        uri, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    return int(count)


def test_a_kept_lock_acquires_and_releases_in_two_round_trips(
    pg_server: PostgresServer, name: str
) -> None:
    """An uncontended acquire+release on a kept session is two messages, two transactions.

    The try that also draws the fence and checks N, then the release. Counted by the server
    (pg_stat_database), not by lockrun; it was 3 to 5 before.
    """
    cycles = 40
    before = _commits(pg_server.uri)
    lock = Lock(name, uri=pg_server.uri)
    for _ in range(cycles):
        with lock as lease:
            assert lease.fence
    lock.close()  # a backend flushes its counts when it exits
    time.sleep(1)
    # At most two messages per cycle, and a few of set-up and of our own, not three.
    committed = _commits(pg_server.uri) - before
    assert committed <= 2 * cycles + 8, committed


@pytest.mark.slow
def test_a_standby_is_refused_with_69(pg_server: PostgresServer, name: str) -> None:
    """A hot standby's advisory locks are its own: 69 naming it; read-write picks the primary."""
    with open(os.path.join(pg_server.data, "pg_hba.conf"), "a") as hba:
        hba.write("local replication lockrun trust\n")
    pg_server.command("SELECT pg_reload_conf()")
    standby = PostgresServer(standby_of=pg_server)
    try:
        assert query(standby.uri, "SELECT pg_is_in_recovery()") == [(True,)]
        needles = ("is a standby (in recovery)", "target_session_attrs=read-write")
        assert_refused(standby.uri, name, ExitCode.UNAVAILABLE, *needles)
        both = (
            f"postgresql://lockrun@/lockrun?host={standby.directory},{pg_server.directory}"
            f"&port={standby.port},{pg_server.port}&target_session_attrs=read-write"
        )
        result = lockrun("--uri", both, "-n", name, "--", "echo", "ran")
        assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", "")
    finally:
        standby.close()


# -- H. the Python API and the backend itself: lost sessions, checks, other roles ------------------


PASSWORD = "pw-for-roles"  # noqa: S105 - the throwaway server's


def role_uri(server: PostgresServer, role: str) -> str:
    """Create *role* (password login) on *server* and return a URI without the password."""
    server.command(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    return f"postgresql://{role}@/lockrun?host={server.directory}&port={server.port}"


def as_role() -> dict[str, str]:
    """Return an environment in which libpq finds the roles' password (PGPASSWORD)."""
    return {**os.environ, "PGPASSWORD": PASSWORD}


def test_a_check_finds_a_lock_given_back_on_a_live_session(postgres_uri: str, name: str) -> None:
    """The check asks pg_locks, not merely whether the session lives."""
    backend = open_backend(parse_uri(postgres_uri), ttl=5)
    request = Request("default", name, 1, 5, Holder.me(["test"]))
    lease = backend.acquire(request, None)
    assert lease is not None
    lease.refresh()
    lease.session.rows("SELECT pg_advisory_unlock_all()", timeout=5)  # type: ignore[attr-defined]
    with pytest.raises(LeaseLost, match="no longer gives this session the lock"):
        lease.refresh()
    lease.release()
    lease.release()
    lease.refresh()  # released: nothing to prove, and no error
    backend.close()


def test_a_waiter_cancelled_on_the_server_queues_again(
    pg_server: PostgresServer,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., Popen[str]],
) -> None:
    """pg_cancel_backend of a waiting session: the waiter asks again and runs when free."""
    uri = pg_server.uri
    holder = held("--uri", uri, "-n", name)
    waiter = spawn("--uri", uri, "-n", name, "-w", "forever", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter in the queue")
    cancelled = pg_server.command(
        "SELECT count(pg_cancel_backend(pid)) FROM pg_locks "
        "WHERE locktype = 'advisory' AND NOT granted"
    )
    assert cancelled == "1"
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter queued again")
    assert waiter.poll() is None
    assert holder.finish() == 0
    assert finish(waiter) == 0


def test_fence_without_pg_logical_emit_message(pg_server: PostgresServer, name: str) -> None:
    """Where the durable write is not allowed, the fence is the bare id and -v says so."""
    uri = role_uri(pg_server, "plain")
    for signature in ("boolean, text, text", "boolean, text, bytea"):
        pg_server.command(
            f"REVOKE EXECUTE ON FUNCTION pg_logical_emit_message({signature}) FROM PUBLIC"
        )
    before = int(pg_server.command("SELECT pg_current_xact_id()"))
    result = lockrun(
        "--uri", uri, "-n", name, "-v", "--", "sh", "-c", "echo $LOCKRUN_FENCE", env=as_role()
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > before
    assert "pg_logical_emit_message is not allowed" in result.stderr
    again = lockrun(
        "--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE", env=as_role()
    )
    assert int(again.stdout) > int(result.stdout)


def test_another_roles_holder_shows_as_its_session(
    pg_server: PostgresServer, name: str, held: Callable[..., Held]
) -> None:
    """Another role's statements are unreadable: status and the mismatch use pg_locks alone.

    Without pg_read_all_stats pg_stat_activity hides another role's statements, so the
    comment naming its lockrun; what pg_locks and the session's row show to everyone remains.
    """
    alice, bob = role_uri(pg_server, "alice"), role_uri(pg_server, "bob")
    os.environ["PGPASSWORD"] = PASSWORD  # for the held factory's process
    try:
        holder = held("--uri", alice, "-n", name, "-s", "2")
    finally:
        del os.environ["PGPASSWORD"]
    shown = lockrun("status", "--uri", bob, "--json", name, env=as_role())
    assert shown.returncode == 0, shown.stderr
    [state] = json.loads(shown.stdout)
    [seen] = state["holders"]
    assert seen["user"] == "alice"
    assert seen["host"].startswith("local socket (backend ")
    assert seen["slot"] == 0
    assert state["slots"] == 2  # from the shared (name, N) lock everyone can see
    refused = lockrun("--uri", bob, "-n", name, "--", "true", env=as_role())
    assert refused.returncode == 78
    line = one_line(refused.stderr)  # another role's holder: the number, but nobody named
    assert (
        "in use with 2 slots, but this one asks for 1 slot; all users of a name must agree" in line
    )
    assert holder.finish() == 0


def test_sessions_outlast_the_lease_and_commit_to_disk(pg_server: PostgresServer) -> None:
    """The server's keepalive gives up on a silent lockrun only after its lease; commits flush.

    A server that dropped a silent holder's session sooner would free the lock before the
    supervisor stops the command; a role's synchronous_commit = off would let a crash hand
    the same transaction-id fence out twice (where lockrun_fences cannot be made).
    """
    backend = open_backend(parse_uri(pg_server.tcp_uri), ttl=30)
    session = backend.server.session()  # type: ignore[attr-defined]
    try:
        idle, interval, count, commit, idle_limit = session.rows(
            "SELECT current_setting('tcp_keepalives_idle'), "
            "current_setting('tcp_keepalives_interval'), "
            "current_setting('tcp_keepalives_count'), current_setting('synchronous_commit'), "
            "current_setting('idle_session_timeout')",
            timeout=5,
        )[0]
    finally:
        session.close()
    assert int(idle) + int(interval) * int(count) >= 30  # over TCP, so the server uses them
    assert commit == "local"
    assert idle_limit == "30s"


def test_a_shared_key_collision_is_not_a_slots_mismatch(
    pg_server: PostgresServer, name: str
) -> None:
    """The (name, N) lock is 32 bits: a holder whose comment names another lock is ignored."""
    key = slots_key("default", name)
    other = json.dumps(
        {
            "token": "t",
            "namespace": "default",
            "name": f"{name}-other",
            "slots": 5,
            "holder": {"host": "h", "pid": 1, "user": "u", "argv": []},
        }
    )
    tagged = f"/* lockrun {other} */ SELECT pg_advisory_lock_shared({key}, 5), pg_sleep(60)"
    psql = (postgres_bin("psql"), "-X", "-h", pg_server.directory, "-p", str(pg_server.port))
    impostor = subprocess.Popen([*psql, "-U", "lockrun", "-d", "lockrun", "-c", tagged])
    try:
        granted = "SELECT count(*) FROM pg_locks WHERE objsubid = 2 AND objid = 5 AND granted"
        wait_for(lambda: pg_server.command(granted) == "1", what="the colliding shared lock")
        result = lockrun("--uri", pg_server.uri, "-n", name, "--", "true")
        assert result.returncode == 0, result.stderr
        untagged = lockrun("--uri", pg_server.uri, "-n", name, "-s", "2", "--", "true")
        assert untagged.returncode == 0, untagged.stderr
    finally:
        impostor.kill()
        impostor.wait(10)
