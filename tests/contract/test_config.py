"""Passwords, users, databases and URIs on every server backend: 69 or 78, and never a secret.

Each scenario runs once per server backend of the registry, against a server of this module's
own with password users (`Secured`). How a backend writes a user, a socket or a database in
its URI, and the words its server uses, are the per-backend rows of `secured`; the checks
are the same for all.
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pytest

from lockrun import ConfigError, ExitCode
from lockrun.backends import open_backend, parse_uri
from lockrun.uri import SCHEMES, Scheme, redact
from tests.support.cli import lockrun, one_line, refused_in_process
from tests.support.harness import SERVERS
from tests.support.net import HOST, ME, create_user, encoded, secret_free
from tests.support.servers import EtcdServer, MariaServer, PostgresServer, RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.support.cli import Held

SECRET = "S3cr3t-pw"  # noqa: S105 - the throwaway servers' password that must never show
ODD = "p@ss:w/rd"  # a password that must be %-encoded in a URI
WRONG = "wrong-pw-1"


class Secured(NamedTuple):
    """A server whose users ``app`` (SECRET) and ``odd`` (ODD) may lock, and others may not.

    `tcp` and `local` write a URI from (user, password, database), the password %-encoded;
    `database` is where locks go, `nosuch` a database the server lacks.
    """

    scheme: str
    server: Any
    tcp: Callable[[str, str | None, str], str]
    # The same over a unix socket; None where the backend has none (etcd).
    local: Callable[[str, str | None, str], str] | None
    database: str
    # None where a URI names no database (etcd): nothing to be unknown.
    nosuch: str | None
    # A URI without a password that the server lets in (None: it has none).
    open_uri: str | None
    # A user (and password) the server tells whether a database exists.
    owner: tuple[str, str | None]
    # More spellings of a wrong password, and of the right one, that this backend accepts.
    wrong: tuple[str, ...]
    right: tuple[str, ...]
    # Users the server lets in (or not) but who may not lock: (URI, what the line says).
    denied: tuple[tuple[str, tuple[str, ...]], ...]
    # Words the server's refusal of a password carries: one of each group of alternatives.
    refusal: tuple[tuple[str, ...], ...]
    # Whether nothing was written where the denied users point (None: not asked).
    untouched: Callable[[], bool] | None = None
    # More URIs naming the database `nosuch`, and how the line quotes its name.
    unknown: tuple[str, ...] = ()
    quoted: str = "{}"

    def uri(
        self,
        user: str = "",
        password: str | None = None,
        *,
        local: bool = False,
        database: str | None = None,
    ) -> str:
        """Return the URI of *user* with *password*, over TCP or the socket (if it has one)."""
        write = self.local if local and self.local is not None else self.tcp
        return write(user, password, self.database if database is None else database)


def userinfo(user: str, password: str | None) -> str:
    """Return ``USER:PASSWORD@`` (password %-encoded), ``USER@`` or nothing."""
    written = user if password is None else f"{user}:{encoded(password)}"
    return f"{written}@" if written else ""


def redis_secured() -> Secured:
    """Return a Redis whose default user needs SECRET, with ACL users app, odd and two others.

    ``noscript`` may not run scripts; ``otherkeys`` may not touch lockrun's keys. The default
    user's password is set once the server runs: RedisServer's readiness PING has none.
    """
    users = (
        ("app", SECRET, "+@all"),
        ("odd", ODD, "+@all"),
        ("noscript", "pw-locky", "+@all -@scripting"),
        ("otherkeys", "pw-locky", "+@all"),
    )
    options: list[str] = []
    for user, password, rules in users:
        keys = "~app:*" if user == "otherkeys" else "~*"
        options += ["--user", user, "on", f">{password}", keys, "&*", *rules.split()]
    server = RedisServer(*options, port=free_port())
    server.command("CONFIG", "SET", "requirepass", SECRET)

    def tcp(user: str, password: str | None, database: str) -> str:
        return f"redis://{userinfo(user, password)}127.0.0.1:{server.port}/{database}"

    def socket(user: str, password: str | None, database: str) -> str:
        credentials = (f"&username={user}" if user else "") + (
            f"&password={encoded(password)}" if password is not None else ""
        )
        return f"unix://{server.socket}?db={database}{credentials}"

    denied = tuple(
        (f"redis://{user}:pw-locky@127.0.0.1:{server.port}/5", ("lacks a permission",))
        for user in ("noscript", "otherkeys")
    )

    def untouched() -> bool:
        return server.command("--user", "app", "--pass", SECRET, "-n", "5", "KEYS", "*") == ""

    return Secured(
        scheme="redis",
        server=server,
        tcp=tcp,
        local=socket,
        database="0",
        nosuch="99",
        open_uri=None,
        owner=("app", SECRET),
        wrong=(
            f"redis://:{WRONG}@127.0.0.1:{server.port}/0",
            f"redis://127.0.0.1:{server.port}/0",
            f"redis://default:{WRONG}@127.0.0.1:{server.port}/0",
            f"unix://{server.socket}?password={WRONG}",
        ),
        right=(f"redis://:{SECRET}@127.0.0.1:{server.port}/0", f"{server.uri}?password={SECRET}"),
        denied=denied,
        refusal=(("authentication failed", "requires a password"),),
        untouched=untouched,
    )


def mysql_secured() -> Secured:
    """Return a MariaDB where app and odd may do anything in lockrun, and nobody only log in."""
    server = MariaServer(port=free_port())
    create_user(server, "app", SECRET, "ALL ON lockrun.*")
    create_user(server, "odd", ODD, "ALL ON lockrun.*")
    create_user(server, "nobody", "pw-nobody")
    tcp = f"127.0.0.1:{server.port}"
    return Secured(
        scheme="mysql",
        server=server,
        tcp=lambda user, password, database: f"mysql://{userinfo(user, password)}{tcp}/{database}",
        local=lambda user, password, database: (
            f"mariadb://{userinfo(user, password)}localhost/{database}?unix_socket={server.socket}"
        ),
        database="lockrun",
        nosuch="nosuch",
        open_uri=server.uri,
        owner=("root", None),
        wrong=(),
        right=(),
        denied=(
            (
                f"mysql://nobody:pw-nobody@{tcp}/lockrun",
                ("to database 'lockrun'", "Access denied for user"),
            ),
            # The server will not tell a database it lacks from one the user may not use.
            (f"mysql://app:{SECRET}@{tcp}/nosuch", ("to database 'nosuch'", "Access denied for")),
        ),
        refusal=(("authentication failed",),),
    )


def postgres_secured() -> Secured:
    """Return a PostgreSQL whose roles app and odd may connect to lockrun; others may not.

    noconn lacks CONNECT on the database; nolog may not log in at all.
    """
    server = PostgresServer(port=free_port())
    server.command(f"CREATE ROLE app LOGIN PASSWORD '{SECRET}'")
    server.command(f"CREATE ROLE odd LOGIN PASSWORD '{ODD}'")
    server.command("CREATE ROLE noconn LOGIN PASSWORD 'pw-noconn'")
    server.command("CREATE ROLE nolog PASSWORD 'pw-x9q'")
    server.command("REVOKE CONNECT ON DATABASE lockrun FROM PUBLIC")
    server.command("GRANT CONNECT ON DATABASE lockrun TO app, odd")
    tcp = f"127.0.0.1:{server.port}"
    where = f"host={server.directory}&port={server.port}"
    return Secured(
        scheme="postgresql",
        server=server,
        tcp=lambda user, password, database: (
            f"postgresql://{userinfo(user, password)}{tcp}/{database}"
        ),
        local=lambda user, password, database: (
            f"postgres://{userinfo(user, password)}/{database}?{where}"
        ),
        database="lockrun",
        nosuch="nosuchdb",
        open_uri=server.uri,
        owner=("lockrun", None),
        unknown=(f"postgresql://app:{SECRET}@{tcp}/nosuchdb",),
        quoted='"{}"',
        wrong=(f"postgresql:///lockrun?{where}&user=app&password={WRONG}",),
        right=(f"postgresql:///lockrun?{where}&user=app&password={SECRET}",),
        denied=(
            (
                f"postgresql://noconn:pw-noconn@{tcp}/lockrun",
                ("User does not have CONNECT privilege",),
            ),
            (
                f"postgresql://noconn:pw-noconn@/lockrun?{where}",
                ("permission denied for database",),
            ),
            (
                f"postgresql://nolog:pw-x9q@{tcp}/lockrun",
                ('role "***" is not permitted to log in',),
            ),
        ),
        refusal=(
            ("authentication failed",),
            ("password authentication failed", "no password supplied"),
        ),
    )


def etcd_secured() -> Secured:
    """Return an etcd with auth on: app and odd may read and write lockrun/, nobody nothing."""
    server = EtcdServer(port=free_port())
    server.add_user("app", SECRET)
    server.add_user("odd", ODD)
    server.add_user("nobody", "pw-nobody", prefix=None)
    server.enable_auth()
    tcp = f"127.0.0.1:{server.port}"
    return Secured(
        scheme="etcd",
        server=server,
        tcp=lambda user, password, _database: f"etcd://{userinfo(user, password)}{tcp}",
        local=None,
        database="",
        nosuch=None,
        open_uri=None,
        owner=("root", None),
        wrong=(),
        right=(),
        denied=((f"etcd://nobody:pw-nobody@{tcp}", ("permission denied",)),),
        refusal=(("authentication failed",),),
    )


SECURED: dict[str, Callable[[], Secured]] = {
    "redis": redis_secured,
    "mysql": mysql_secured,
    "postgres": postgres_secured,
    "etcd": etcd_secured,
}


@pytest.fixture(scope="module", params=SERVERS)
def secured(request: pytest.FixtureRequest) -> Iterator[Secured]:
    """Return each server backend's `Secured` server, shared by this module's tests."""
    made = SECURED[request.param]()
    yield made
    made.server.close()


@pytest.fixture(autouse=True)
def _no_pg_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep the developer's PG* settings and ~/.pgpass out of the tests."""
    for variable in list(os.environ):
        if variable.startswith("PG"):
            monkeypatch.delenv(variable)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-pgpass"))


@pytest.mark.slow
def test_passwords_are_checked_and_never_printed(secured: Secured, name: str) -> None:
    """A wrong, missing or unknown user's password: 69, one line, none printed; the right runs."""
    wrong = (
        secured.uri("app", WRONG),
        secured.uri("app"),
        secured.uri("nosuchuser", SECRET),
        secured.uri("app", WRONG, local=True),
        *secured.wrong,
    )
    for uri in wrong:
        for args in (
            ("-v", "--uri", uri, "-n", name, "--", "echo", "ran"),
            ("status", "--uri", uri),
            ("status", "--uri", uri, "--json", name),
        ):
            result = lockrun(*args)
            assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, ""), args
            line = one_line(result.stderr)
            for words in secured.refusal:
                assert any(word in line for word in words), line
            secret_free(result, SECRET, WRONG)
    for uri in (secured.uri("app", SECRET), secured.uri("app", SECRET, local=True), *secured.right):
        result = lockrun("--uri", uri, "-n", name, "--", "echo", "ran")
        assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", ""), uri


def test_a_percent_encoded_password_is_decoded(secured: Secured, name: str) -> None:
    """A password with @ : / is written %-encoded in the URI and reaches the server decoded."""
    uri = secured.uri("odd", ODD)
    assert "%40" in uri
    result = lockrun("-v", "--uri", uri, "-n", name, "--", "echo", "ran")
    assert (result.returncode, result.stdout) == (0, "ran\n"), result.stderr
    secret_free(result, ODD)


@pytest.mark.slow
def test_a_password_reaches_no_output_and_no_environment(
    secured: Secured, held: Callable[..., Held], name: str
) -> None:
    """-v, busy lines, status (table and JSON) and the command's env carry no password."""
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    uri = secured.uri("app", SECRET)
    result = lockrun("-v", "--uri", uri, "-n", name, "--", "env")
    assert result.returncode == 0, result.stderr
    assert f"LOCKRUN_NAME={name}" in result.stdout.splitlines()
    assert "acquired" in result.stderr
    secret_free(result, SECRET)

    for from_environment in (uri, *secured.right):
        environment = {**os.environ, "LOCKRUN_URI": from_environment}
        result = lockrun("-v", "-n", name, "--", "env", env=environment)
        assert result.returncode == 0, (from_environment, result.stderr)
        assert f"LOCKRUN_URI={redact(from_environment)}" in result.stdout.splitlines()
        secret_free(result, SECRET)
    if (passwordless := secured.open_uri) is not None:
        result = lockrun("-n", name, "--", "env", env={**os.environ, "LOCKRUN_URI": passwordless})
        assert f"LOCKRUN_URI={redact(passwordless)}" in result.stdout.splitlines()

    holder = held("--uri", uri, "-n", name, "--namespace", namespace)
    busy = lockrun(
        "-v", "--wait", "0.2", "--uri", uri, "-n", name, "--namespace", namespace, "--", "true"
    )
    assert busy.returncode == ExitCode.BUSY
    assert f"held by {ME}@{HOST} pid {holder.process.pid}" in busy.stderr
    assert f"{secured.scheme}://***@" in busy.stderr
    secret_free(busy, SECRET)
    for args in (("--json", name), (name,), ("--json",), ()):
        result = lockrun("status", "--uri", uri, "--namespace", namespace, *args)
        assert result.returncode == 0, result.stderr
        assert str(holder.process.pid) in result.stdout
        secret_free(result, SECRET)
    assert holder.finish() == 0

    result = lockrun("status", "--uri", uri, "--namespace", namespace)
    assert result.stdout.startswith("no locks held or awaited")
    assert f"{secured.scheme}://***@" in result.stdout
    secret_free(result, SECRET)


@pytest.mark.slow
def test_an_unknown_database_exits_78_naming_it(secured: Secured, name: str) -> None:
    """A database the server lacks is a configuration error (78), one line naming it."""
    if secured.nosuch is None:
        pytest.skip(f"a {secured.scheme} URI names no database")
    for uri in (
        secured.uri(*secured.owner, database=secured.nosuch),
        secured.uri(*secured.owner, database=secured.nosuch, local=True),
        *secured.unknown,
    ):
        for args in (
            ("--ttl", "3", "--uri", uri, "-n", name, "--", "echo", "ran"),
            ("status", "--uri", uri, name),
            ("status", "--uri", uri),
        ):
            result = lockrun(*args)
            assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), (uri, args)
            line = one_line(result.stderr)
            assert "no such database" in line
            assert secured.quoted.format(secured.nosuch) in line
            secret_free(result, SECRET)


def test_a_user_without_access_exits_69(secured: Secured, name: str) -> None:
    """A user who may not use the database, or not lockrun's keys: 69, one line, no password."""
    for uri, needles in secured.denied:
        for args in (
            ("--uri", uri, "-n", name, "--", "echo", "ran"),
            ("status", "--uri", uri, name),
        ):
            result = lockrun(*args)
            assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, ""), (uri, args)
            line = one_line(result.stderr)
            assert all(needle in line for needle in needles), line
            secret_free(result, SECRET, "pw-locky", "pw-nobody", "pw-noconn", "pw-x9q")
    if secured.untouched is not None:
        assert secured.untouched()


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheme whose driver is not installed is a configuration error naming the extra."""
    monkeypatch.setitem(SCHEMES, "nosuch", Scheme("nosuch", "nosuch:", {}, extra="nosuch"))
    with pytest.raises(ConfigError, match=r"pip install 'lockrun-cli\[nosuch\]'"):
        open_backend(parse_uri("nosuch://x"))


# Each backend's malformed URIs: what the one line names, and the secrets it must not show.
BAD_URIS: Final = {
    "redis-foo": ("redis://127.0.0.1:1/0?foo=1", "unknown option 'foo'", ()),
    "redis-tls-option": (
        "redis://127.0.0.1:1/0?ssl_ca_certs=/ca.pem",
        "unknown option 'ssl_ca_certs'",
        (),
    ),
    "unix-timeout": ("unix:///tmp/r.sock?timeout=3", "unknown option 'timeout'", ()),
    "sentinel-password": (
        "redis+sentinel://127.0.0.1:1/m?password=x",
        "unknown option 'password'",
        (),
    ),
    "redis-two-passwords": (
        "redis://:hunter2@127.0.0.1:1/0?password=x",
        "unknown option 'password'",
        ("hunter2",),
    ),
    "rediss-cert-reqs": ("rediss://127.0.0.1:1?ssl_cert_reqs=maybe", "ssl_cert_reqs", ()),
    "redis-port-99999": ("redis://127.0.0.1:99999/0", "port 99999 is out of range", ()),
    "redis-port-0": ("redis://127.0.0.1:0/0", "port 0 is out of range", ()),
    # No @: what follows a colon may be a password (redis://user:password), so not shown.
    "redis-port-abc": ("redis://127.0.0.1:abc/0", "no HOST[:PORT]", ("abc",)),
    "redis-two-ports": ("redis://127.0.0.1:1:2/0", "no HOST[:PORT]", ()),
    "redis-ipv6-unclosed": ("redis://[::1/0", "no HOST[:PORT]", ()),
    "redis-db-path": ("redis://127.0.0.1:1/0/1", "'0/1' is not a number", ()),
    "unix-no-path": ("unix://", "expected unix:///path", ()),
    "sentinel-no-service": ("redis+sentinel://127.0.0.1:1", "SERVICE", ()),
    "cluster-database": ("redis+cluster://127.0.0.1:1,127.0.0.1:2/3", "database 0 alone", ()),
    "cluster-db-option": ("redis+cluster://127.0.0.1:1?db=0", "unknown option 'db'", ()),
    "cluster-tls-option": (
        "redis+cluster://127.0.0.1:1?ssl_ca_certs=/ca.pem",
        "unknown option 'ssl_ca_certs'",
        (),
    ),
    "cluster-password": (
        f"rediss+cluster://:{SECRET}@127.0.0.1:1,127.0.0.1:99999",
        "port 99999 is out of range",
        (SECRET,),
    ),
    # A CA, certificate or key file that cannot be read is 78 naming it (not 69).
    "rediss-missing-ca": (
        "rediss://127.0.0.1:1/0?ssl_ca_certs=/nonexistent/ca.pem",
        "/nonexistent/ca.pem",
        (),
    ),
    "mysql-missing-ca": (
        f"mysql://root:{SECRET}@127.0.0.1:1/lockrun?ssl_ca=/nonexistent/ca.pem",
        "/nonexistent/ca.pem",
        (SECRET,),
    ),
    "mysql-question-mark": ("mysql://app:hunter?2@127.0.0.1:1/lockrun", "", ("hunter?2",)),
    "mysql-hash": ("mysql://app:hunter#2@127.0.0.1:1/lockrun", "", ("hunter#2",)),
    "mysql-charset": (
        f"mysql://root:{SECRET}@127.0.0.1:1/lockrun?charset=nope",
        "unknown charset 'nope'",
        (SECRET,),
    ),
    "postgres-foo": (
        f"postgresql://app:{SECRET}@127.0.0.1:1/lockrun?foo=bar",
        "not a libpq connection URI",
        (SECRET,),
    ),
    "postgres-bad-escape": (
        "postgresql://app:p@ss%zz@127.0.0.1:1/lockrun",
        "not a libpq connection URI",
        ("p@ss%zz", "ss%zz"),
    ),
    "postgres-password-not-utf8": ("postgresql://app:%ff%fe@127.0.0.1:1/lockrun", "", ()),
    "postgres-database-not-utf8": ("postgresql://127.0.0.1:1/l%ff", "", ()),
}


def bad_uri_args(how: str, uri: str, name: str) -> tuple[str, ...]:
    """Return the arguments of `lockrun` or `lockrun status` (*how*) that meet *uri*."""
    if how == "status":
        return ("status", "--uri", uri)
    return ("-v", "--ttl", "3", "--uri", uri, "-n", name, "--", "echo", "ran")


# Each bad URI only feeds the parsers: the sweep runs the CLI in this process (what `lockrun`
# does past its start-up); the test below runs two as processes.
@pytest.mark.parametrize("how", ["run", "status"])
@pytest.mark.parametrize(("uri", "needle", "secrets"), BAD_URIS.values(), ids=BAD_URIS)
def test_bad_uris_exit_78_without_the_password(
    uri: str,
    needle: str,
    secrets: tuple[str, ...],
    how: str,
    name: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Unknown options, malformed ports, paths and escapes: 78 before any connection, one line.

    No piece of a password shows, however malformed the URI around it.
    """
    result = refused_in_process(capfd, *bad_uri_args(how, uri, name))
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
    assert needle in one_line(result.stderr)
    secret_free(result, *secrets)


@pytest.mark.parametrize("how", ["run", "status"])
def test_a_bad_uri_exits_78_without_the_password_from_a_process(how: str, name: str) -> None:
    """The same from `python -m lockrun`: a driver's refusal (libpq's), with a password in it."""
    uri, needle, secrets = BAD_URIS["postgres-foo"]
    result = lockrun(*bad_uri_args(how, uri, name))
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
    assert needle in one_line(result.stderr)
    secret_free(result, *secrets)
