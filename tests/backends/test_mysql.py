"""What only MySQL/MariaDB does: URIs, GET_LOCK names, greetings, privileges, option files, TLS.

What every backend shares (status, passwords, unreachable servers, bad URIs) is in
tests/contract. Every server here is a real mariadbd of the test's own (or the session's), on
a unix socket or a loopback port; the stand-ins that greet like MySQL are sockets of our own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import ssl
import threading
import uuid
from subprocess import PIPE
from typing import TYPE_CHECKING

import pymysql
import pytest
from pymysql.constants import CLIENT

from lockrun import ConfigError, ExitCode, Lock
from lockrun.backends import Holder, Request, parse_uri
from lockrun.backends.mysql import connect, lock_key, parse
from lockrun.timing import now
from tests.support.cli import lockrun, one_line, wait_for
from tests.support.net import (
    DRIVER_TIMEOUT,
    HOST,
    ME,
    Greeter,
    assert_refused,
    create_user,
    make_certificates,
    secret_free,
)
from tests.support.net import mysql_query as query
from tests.support.servers import MariaServer, free_port, unavailable

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from subprocess import Popen

    from tests.support.cli import Held


SECRET = "s3cret-pw"  # noqa: S105 - the throwaway servers' password that must never show
# --ttl 3 makes every connect or answer give up after timeout_for(3) = 1 s.
SHORT_TTL = "3"
GALERA = "/usr/lib/galera/libgalera_smm.so"
# MySQL refuses GET_LOCK names longer than this (ER_USER_LOCK_WRONG_NAME).
MAX_LOCK_NAME = 64


def server_key(uri: str, namespace: str, name: str) -> str:
    """Return the lock key the server itself computes for (namespace, name)."""
    [[key]] = query(
        uri, "SELECT CONCAT('lr:', LEFT(SHA2(CONCAT(%s, '\\0', %s), 256), 40))", (namespace, name)
    )
    return str(key)


def holding_connection(uri: str, lock: str) -> int | None:
    """Return the id of the session that holds GET_LOCK *lock* on the server, or None."""
    [[connection]] = query(uri, "SELECT IS_USED_LOCK(%s)", (lock,))
    return None if connection is None else int(connection)


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[MariaServer]:
    """Return a MariaDB with a loopback port and users of every kind, shared by this module.

    ``secret`` may do anything in ``lockrun``; ``dml`` may only read and write rows in
    ``lockrun`` and ``bare`` (where nobody creates lockrun's tables); ``nobody`` may only log
    in.
    """
    server = MariaServer(port=free_port())
    try:
        server.command("CREATE DATABASE bare")
        create_user(server, "secret", SECRET, "ALL ON lockrun.*")
        dml = "SELECT, INSERT, UPDATE, DELETE"
        create_user(server, "dml", "pw-dml", f"{dml} ON lockrun.*", f"{dml} ON bare.*")
        create_user(server, "nobody", "pw-nobody")
    except BaseException:
        server.close()
        raise
    yield server
    server.close()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a directory with a CA, server and client certificates, another CA, and garbage."""
    directory = tmp_path_factory.mktemp("certificates")
    make_certificates(directory)
    (directory / "garbage.pem").write_text("not a certificate\n")
    return directory


# -- A. URI parsing and lock keys, in process ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "mysql://",
            {"user": None, "password": "", "database": None, "charset": "utf8mb4"},
        ),
        # No port: PyMySQL takes the option file's, else 3306.
        ("mysql://db.internal", {"host": "db.internal", "port": None, "database": None}),
        ("mysql://db.internal/", {"host": "db.internal", "port": None, "database": None}),
        ("mysql://127.0.0.1:3307/app", {"host": "127.0.0.1", "port": 3307, "database": "app"}),
        ("mysql://[::1]:3307/app", {"host": "::1", "port": 3307, "database": "app"}),
        ("mysql://[::1]/app", {"host": "::1", "port": None}),
        ("mysql://ci@db/ci", {"user": "ci", "password": "", "database": "ci"}),
        ("mysql://ci:pw@db/ci", {"user": "ci", "password": "pw"}),
        ("mysql://ci:pw:more@db", {"user": "ci", "password": "pw:more"}),
        ("mysql://u%40corp:p%3Aw%2Fd%40x@db", {"user": "u@corp", "password": "p:w/d@x"}),
        ("mysql://db/d%C3%A4ta", {"database": "däta"}),
        ("mysql://db/app?charset=latin1", {"charset": "latin1"}),
        ("mysql:///app?unix_socket=/run/my.sock", {"unix_socket": "/run/my.sock", "host": None}),
        ("mysql://localhost/app?unix_socket=/run/my.sock", {"host": "localhost"}),
        ("mysql://db/app?unix_socket=", {"unix_socket": None}),
        ("mariadb://ci:pw@db:3310/ci", {"user": "ci", "password": "pw", "port": 3310}),
    ],
)
def test_parse_maps_uris_to_pymysql_settings(text: str, expected: dict[str, object]) -> None:
    """User, %-decoded password, host, port (3306), database, socket and charset reach PyMySQL."""
    settings = parse(parse_uri(text))
    assert {key: settings.kwargs.get(key) for key in expected} == expected
    assert "ssl_verify_identity" not in settings.kwargs
    assert "pw" not in settings.where.replace("//", "")


def test_mariadb_is_the_same_backend_as_mysql(certificates: Path) -> None:
    """mariadb:// gives exactly the settings of mysql://, options included."""
    rest = f"//u:pw@db:3307/app?charset=latin1&ssl_ca={certificates}/ca.crt"
    mysql = parse(parse_uri(f"mysql:{rest}"))
    mariadb = parse(parse_uri(f"mariadb:{rest}"))
    assert mysql.kwargs == mariadb.kwargs
    assert mariadb.where == f"mariadb://***@db:3307/app?charset=latin1&ssl_ca={certificates}/ca.crt"


def test_parse_tls_files_must_be_readable_and_a_ca_checks_the_name(
    tmp_path: Path, certificates: Path
) -> None:
    """ssl_ca/ssl_cert/ssl_key go to PyMySQL as given; a CA turns on the host name check."""
    ca, cert, key = (str(certificates / pem) for pem in ("ca.crt", "client.crt", "client.key"))
    settings = parse(parse_uri(f"mysql://db/app?ssl_ca={ca}&ssl_cert={cert}&ssl_key={key}"))
    given = {option: settings.kwargs.get(option) for option in ("ssl_ca", "ssl_cert", "ssl_key")}
    assert given == {"ssl_ca": ca, "ssl_cert": cert, "ssl_key": key}
    assert settings.kwargs["ssl_verify_identity"] is True
    client_only = parse(parse_uri(f"mysql://db/app?ssl_cert={cert}&ssl_key={key}")).kwargs
    assert "ssl_verify_identity" not in client_only
    (tmp_path / "locked.pem").write_text("")
    (tmp_path / "locked.pem").chmod(0)
    for option in ("ssl_ca", "ssl_cert", "ssl_key"):
        path = f"{tmp_path}/missing.pem"
        with pytest.raises(ConfigError, match=re.escape(f"{option} {path}: no such readable")):
            parse(parse_uri(f"mysql://u:{SECRET}@db/app?{option}={path}"))
        if os.geteuid() != 0:  # root reads a mode-0 file
            with pytest.raises(ConfigError, match="no such readable file"):
                parse(parse_uri(f"mysql://db/app?{option}={tmp_path}/locked.pem"))


def test_without_tls_options_no_ca_store_is_loaded(
    monkeypatch: pytest.MonkeyPatch, mysql_uri: str, name: str
) -> None:
    """A URI without ssl_* never loads the system's CA store (20–40 ms a start-up), yet locks."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        msg = "the CA store was loaded"
        raise AssertionError(msg)

    monkeypatch.setattr(ssl.SSLContext, "load_default_certs", refuse)
    monkeypatch.setattr(ssl.SSLContext, "set_default_verify_paths", refuse)
    with Lock(name, uri=mysql_uri) as lease:
        assert lease.slot == 0


def test_parse_expands_the_tilde_of_read_default_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """?read_default_file=~/.my.cnf is looked up in $HOME; a missing one is a ConfigError."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".my.cnf").write_text("[client]\nuser=app\n")
    settings = parse(parse_uri("mysql://db/app?read_default_file=~/.my.cnf"))
    assert settings.kwargs["read_default_file"] == f"{tmp_path}/.my.cnf"
    assert settings.where == "mysql://db/app?read_default_file=~/.my.cnf"
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(f"mysql://u:{SECRET}@db/app?read_default_file=~/other.cnf"))
    assert f"read_default_file {tmp_path}/other.cnf" in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (f"mysql://u:{SECRET}@db/app?foo=1", "unknown option 'foo'"),
        (f"mysql://u:{SECRET}@db/app?password=x", "unknown option 'password'"),
        (
            f"mysql://u:{SECRET}@db/app?ssl_verify_identity=0",
            "unknown option 'ssl_verify_identity'",
        ),
        (f"mysql://u:{SECRET}@db/app?ssl_ca=", "ssl_ca"),
        (f"mysql://u:{SECRET}@db/app?read_default_file=/nonexistent.cnf", "/nonexistent.cnf"),
        (f"mysql://u:{SECRET}@db/app/more", "expected mysql://"),
        (f"mysql://u:{SECRET}@db/a%2Fb", "expected mysql://"),
        (f"mysql://u:{SECRET}@db:99999/app", "port 99999 is out of range"),
        (f"mysql://u:{SECRET}@db:0/app", "port 0 is out of range"),
        (f"mysql://u:{SECRET}@db:abc/app", "HOST[:PORT]"),
        (f"mysql://u:{SECRET}@db:1:2/app", "HOST[:PORT]"),
        (f"mysql://u:{SECRET}@[::1/app", "[IPV6][:PORT]"),
        (f"mariadb://u:{SECRET}@db/app?sslmode=require", "unknown option 'sslmode'"),
    ],
)
def test_parse_rejects_bad_uris_without_showing_the_password(text: str, needle: str) -> None:
    """Unknown options, unreadable files, bad ports and paths raise ConfigError (exit 78)."""
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(text))
    message = str(raised.value)
    assert needle in message
    assert SECRET not in message
    assert "://***@" in message


@pytest.mark.parametrize(
    ("query_text", "refused"),
    [
        ("ssl_ca={dir}", "ssl_ca {dir}: no such readable file"),
        ("ssl_ca={dir}/garbage.pem", "ssl_ca {dir}/garbage.pem: unusable ("),
        (
            "ssl_ca={dir}/ca.crt&ssl_cert={dir}/garbage.pem&ssl_key={dir}/client.key",
            "ssl_cert {dir}/garbage.pem: unusable (",
        ),
        (
            "ssl_ca={dir}/ca.crt&ssl_cert={dir}/client.crt&ssl_key={dir}/server.key",
            "ssl_cert {dir}/client.crt: unusable (",
        ),
    ],
    ids=["ca-is-a-directory", "ca-not-a-certificate", "cert-not-a-certificate", "foreign-key"],
)
def test_parse_refuses_unusable_tls_files(
    query_text: str, refused: str, certificates: Path
) -> None:
    """A CA or certificate that is no PEM, or a key of another certificate: 78, naming it."""
    uri = f"mysql://u:{SECRET}@db/app?{query_text.format(dir=certificates)}"
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(uri))
    assert refused.format(dir=certificates) in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    ("namespace", "name"),
    [
        ("default", "x"),
        ("default", "nightly-etl"),
        ("ns/with space", "a:b*c%d'e\"f\\g"),
        ("default", "Ünïcødé ✓ 名前"),
        ("émoji", "🔒 lock 🔑"),
        ("default", "y" * 255),
    ],
)
def test_lock_key_is_what_the_server_computes(mysql_uri: str, namespace: str, name: str) -> None:
    r"""lock_key() equals CONCAT('lr:', LEFT(SHA2(CONCAT(ns, '\0', name), 256), 40)) in SQL."""
    key = lock_key(namespace, name)
    assert re.fullmatch(r"lr:[0-9a-f]{40}", key)
    assert key == server_key(mysql_uri, namespace, name)


# -- B. names: long, non-ASCII, case ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "n" * 64,
        "n" * 65,
        "n" * 192,
        "n" * 255,
        "ä" * 127,  # 254 bytes of UTF-8
        "Ünïcødé ✓ 名前 🔒 with spaces/and:colons",
    ],
    ids=["64", "65", "192", "255", "254-bytes-of-umlauts", "non-ascii"],
)
def test_any_valid_name_excludes_itself_under_a_short_server_lock_name(
    mysql_uri: str, held: Callable[..., Held], name: str
) -> None:
    """Long and non-ASCII names run, exclude a second user, and become ≤ 64-char GET_LOCKs."""
    unique = f"{uuid.uuid4().hex[:6]}{name}"[: len(name)]
    key = lock_key("default", unique)
    assert len(f"{key}:0") <= MAX_LOCK_NAME
    assert len(f"{key}:gate") <= MAX_LOCK_NAME
    holder = held("--uri", mysql_uri, "-n", unique)
    assert holder.fence > 0
    assert holding_connection(mysql_uri, f"{server_key(mysql_uri, 'default', unique)}:0")
    busy = lockrun("--uri", mysql_uri, "-n", unique, "-w", "0", "--", "echo", "ran")
    assert (busy.returncode, busy.stdout) == (ExitCode.BUSY, "")
    assert unique in one_line(busy.stderr)
    status = lockrun("status", "--uri", mysql_uri, "--json", unique)
    [state] = json.loads(status.stdout)
    assert (state["name"], state["where"]) == (unique, key)
    assert [owner["pid"] for owner in state["holders"]] == [holder.process.pid]
    assert holder.finish() == 0
    assert holding_connection(mysql_uri, f"{key}:0") is None
    again = lockrun("--uri", mysql_uri, "-n", unique, "-w", "0", "--", "echo", "ran")
    assert (again.returncode, again.stdout, again.stderr) == (0, "ran\n", "")


def test_names_that_differ_only_in_case_are_different_locks(
    mysql_uri: str, held: Callable[..., Held], name: str
) -> None:
    """GET_LOCK names are case-insensitive on the server; lockrun's names are not."""
    upper = held("--uri", mysql_uri, "-n", f"Deploy-{name}")
    lower = held("--uri", mysql_uri, "-n", f"deploy-{name}")
    shouting = lockrun("--uri", mysql_uri, "-n", f"DEPLOY-{name}", "--", "echo", "ran")
    assert (shouting.returncode, shouting.stdout, shouting.stderr) == (0, "ran\n", "")
    keys = {lock_key("default", f"{case}-{name}") for case in ("Deploy", "deploy", "DEPLOY")}
    assert len(keys) == 3
    holders = {holding_connection(mysql_uri, f"{key}:0") for key in keys}
    assert len(holders - {None}) == 2  # the two held ones, by two sessions
    busy = lockrun("--uri", mysql_uri, "-n", f"Deploy-{name}", "--", "true")
    assert busy.returncode == ExitCode.BUSY
    assert (upper.finish(), lower.finish()) == (0, 0)


# -- C. a stand-in that greets like MySQL but is not -----------------------------------------------


def _packet(payload: bytes, sequence: int = 0) -> bytes:
    """Frame *payload* as one MySQL protocol packet."""
    return len(payload).to_bytes(3, "little") + bytes([sequence]) + payload


# A greeting, whether the stand-in then keeps the connection silent, and what the line says.
GREETINGS = {
    "short-handshake": (_packet(b"\x0a5.5.5-x\x00"), False, "does not answer like"),
    "truncated-handshake": (
        _packet(b"\x0a8.0.0\x00\x01\x00\x00\x00abcdefgh\x00"),
        True,
        "does not answer like",
    ),
    "protocol-9": (_packet(b"\x09abc"), False, "does not answer like"),
    "huge-packet-then-silence": (b"\xff\xff\xff\x00" + b"a" * 20, True, "no answer within 1s"),
    "huge-packet-then-close": (b"\xff\xff\xff\x00" + b"a" * 20, False, "Lost connection"),
}


@pytest.mark.parametrize(("greeting", "hang", "needle"), GREETINGS.values(), ids=GREETINGS)
def test_a_server_that_is_not_mysql_exits_69(
    greeting: bytes, hang: bool, needle: str, name: str
) -> None:
    """An HTTP or SSH server, garbage or a broken greeting on the port: 69, one line."""
    with contextlib.closing(Greeter(greeting, hang=hang)) as greeter:
        uri = f"mysql://root:{SECRET}@127.0.0.1:{greeter.port}/lockrun"
        result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")  # 60 s
        if hang:
            wait_for(lambda: greeter.waited, what="lockrun to hang up")
    assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, ""), result.stderr
    line = one_line(result.stderr)
    assert f"127.0.0.1:{greeter.port}" in line
    assert needle in line
    assert "internal error" not in line
    secret_free(result, SECRET)
    # The stand-in's clock, greeting to hang-up (no start-up in it): lockrun's timeout, not
    # PyMySQL's own; one that closes is left at once, and `lockrun`'s 60 s guards a hang.
    assert greeter.longest_wait() < DRIVER_TIMEOUT


# -- D. privileges: no CREATE, no fence ------------------------------------------------------------


@pytest.mark.slow
def test_a_user_who_may_not_create_tables_runs_without_a_fence(
    tcp_server: MariaServer, spawn: Callable[..., Popen[str]], name: str
) -> None:
    """No CREATE (or no database at all): exit 0, LOCKRUN_FENCE unset, one -v "no fence" line."""
    tcp = f"127.0.0.1:{tcp_server.port}"
    stale = {**os.environ, "LOCKRUN_FENCE": "12345"}  # must not reach the command either
    for uri in (f"mysql://dml:pw-dml@{tcp}/bare", f"mysql://nobody:pw-nobody@{tcp}"):
        result = lockrun("-v", "--uri", uri, "-n", name, "--", "env", env=stale)
        assert result.returncode == 0, result.stderr
        variables = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
        assert "LOCKRUN_FENCE" not in variables
        assert (variables["LOCKRUN_NAME"], variables["LOCKRUN_SLOT"]) == (name, "0")
        notes = [line for line in result.stderr.splitlines() if "no fence" in line]
        assert len(notes) == 1, result.stderr
        assert "LOCKRUN_FENCE stays unset" in notes[0]
        assert re.search(
            rf"acquired {re.escape(name)} slot 0 of 1 after [0-9.]+s$", result.stderr, re.MULTILINE
        )
        secret_free(result, "pw-dml", "pw-nobody")
        quiet = lockrun("--uri", uri, "-n", name, "--", "echo", "ran")
        assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "ran\n", "")

        # The holder's command says its slot and fence, then holds until its stdin ends.
        script = 'echo "$LOCKRUN_SLOT ${LOCKRUN_FENCE-none}"; read _'
        holder = spawn("--uri", uri, "-n", name, "--", "sh", "-c", script, stdin=PIPE, stdout=PIPE)
        assert holder.stdout is not None
        assert holder.stdout.readline() == "0 none\n"
        busy = lockrun("--uri", uri, "-n", name, "--", "true")
        assert busy.returncode == ExitCode.BUSY
        status = lockrun("status", "--uri", uri, "--json", name)
        assert status.returncode == 0, status.stderr
        [state] = json.loads(status.stdout)
        [owner] = state["holders"]
        assert owner["slot"] == 0
        assert "connection" in owner["host"]
        assert owner["user"] in {"dml", "nobody"}
        table = lockrun("status", "--uri", uri, name)
        assert re.search(rf"^{re.escape(name)}\s+0\s+holding\s", table.stdout, re.MULTILINE), (
            table.stdout
        )
        assert holder.communicate("\n", timeout=30) == ("", "")
        assert holder.returncode == 0
    assert tcp_server.command("SHOW TABLES FROM bare") == ""


def test_a_user_with_only_row_privileges_gets_a_fence_once_the_tables_exist(
    tcp_server: MariaServer, held: Callable[..., Held], name: str
) -> None:
    """Tables made by an earlier root run: SELECT/INSERT/UPDATE/DELETE suffice for fences."""
    root = f"mysql://root@127.0.0.1:{tcp_server.port}/lockrun"
    first = lockrun("--uri", root, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert first.returncode == 0, first.stderr
    assert {"lockrun_fence", "lockrun_holders"} <= set(
        tcp_server.command("SHOW TABLES FROM lockrun").split()
    )
    uri = f"mysql://dml:pw-dml@127.0.0.1:{tcp_server.port}/lockrun"
    second = lockrun("-v", "--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert second.returncode == 0, second.stderr
    assert "no fence" not in second.stderr
    assert int(second.stdout) > int(first.stdout)
    holder = held("--uri", uri, "-n", name)
    assert holder.fence > int(second.stdout)
    [state] = json.loads(lockrun("status", "--uri", uri, "--json", name).stdout)
    [owner] = state["holders"]
    shown = (owner["pid"], owner["user"], owner["host"], owner["slot"])
    assert shown == (holder.process.pid, ME, HOST, 0)
    assert holder.finish() == 0
    key = lock_key("default", name)
    # The row stays for the next holder of the slot to replace (one per slot), but no
    # longer counts: its session holds nothing.
    assert query(uri, "SELECT COUNT(*) FROM lockrun_holders WHERE lock_key = %s", (key,)) == ((1,),)
    live = (
        "SELECT COUNT(*) FROM lockrun_holders WHERE lock_key = %s "
        "AND IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id"
    )
    assert query(uri, live, (key,)) == ((0,),)
    [state] = json.loads(lockrun("status", "--uri", uri, "--json", name).stdout)
    assert state["holders"] == []


def test_a_grant_the_server_refuses_halfway_leaves_no_record_and_no_transaction(
    tcp_server: MariaServer, name: str
) -> None:
    """Records allowed, fences not: the record is rolled back, no fence, no transaction left.

    The grant writes both in one transaction; the session (which may serve the next
    acquisition) must not stay in it after the server refuses the fence.
    """
    root = f"mysql://root@127.0.0.1:{tcp_server.port}/lockrun"
    assert lockrun("--uri", root, "-n", name, "--", "true").returncode == 0  # makes the tables
    holders, fences = "lockrun.lockrun_holders", "lockrun.lockrun_fence"
    create_user(tcp_server, "half", "pw-half", f"ALL ON {holders}", f"SELECT ON {fences}")
    uri = f"mysql://half:pw-half@127.0.0.1:{tcp_server.port}/lockrun"
    notes: list[str] = []
    backend = connect(parse_uri(uri), ttl=10.0, note=notes.append)
    try:
        request = Request("default", name, 1, 10.0, Holder.me(["half"]))
        for _ in range(2):
            lease = backend.acquire(request, now())
            assert lease is not None
            assert lease.fence is None
            assert lease.session.one("SELECT @@in_transaction") == 0
            lease.release()
    finally:
        backend.close()
    assert len(notes) == 1
    assert "no fence" in notes[0]
    key = lock_key("default", name)
    rows = query(root, "SELECT holder FROM lockrun_holders WHERE lock_key = %s", (key,))
    assert all("half" not in holder for (holder,) in rows)


def test_a_refused_n_lets_go_at_once_of_the_slot_its_first_try_caught(
    mysql_uri: str, name: str
) -> None:
    """Slot 0 free, slot 1 held with N = 3: N = 1 is refused (78), slot 0 free again at once.

    The first try takes slot 0 in the round trip of the check that refuses it, so it lets
    go before raising: a session kept for the next acquisition is not hung up on.
    """
    backend = connect(parse_uri(mysql_uri), ttl=10.0)
    try:
        three = Request("default", name, 3, 10.0, Holder.me(["three"]))
        first, second = backend.acquire(three, now()), backend.acquire(three, now())
        assert first is not None
        assert second is not None
        assert (first.slot, second.slot) == (0, 1)
        first.release()
        key = lock_key("default", name)
        for wait in (now(), now() + 1):  # a try alone, and a try before a wait
            with pytest.raises(ConfigError, match=r"in use with 3 slots by .*asks for 1 slot"):
                backend.acquire(three._replace(slots=1), wait)
            assert holding_connection(mysql_uri, f"{key}:0") is None
        again = backend.acquire(three, now())  # the backend is none the worse for it
        assert again is not None
        assert again.slot == 0
        again.release()
        second.release()
    finally:
        backend.close()


# -- E. ~/.my.cnf ----------------------------------------------------------------------------------


def test_read_default_file_supplies_the_user_password_and_server(
    tcp_server: MariaServer, tmp_path: Path, name: str
) -> None:
    """A [client] section gives user, password and socket (or host and port); none is printed."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".my.cnf").write_text(
        f"[client]\nuser=secret\npassword={SECRET}\nsocket={tcp_server.socket}\n"
    )
    (tmp_path / "tcp.cnf").write_text(
        f"[client]\nuser=secret\npassword={SECRET}\nhost=127.0.0.1\nport={tcp_server.port}\n"
    )
    environment = {**os.environ, "HOME": str(home)}
    for uri in (
        "mysql://localhost/lockrun?read_default_file=~/.my.cnf",
        f"mysql://localhost/lockrun?read_default_file={home}/.my.cnf",
        f"mariadb:///lockrun?read_default_file={tmp_path}/tcp.cnf",
    ):
        result = lockrun(
            "-v", "--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE", env=environment
        )
        assert result.returncode == 0, result.stderr
        assert int(result.stdout) > 0
        secret_free(result, SECRET)
        status = lockrun("status", "--uri", uri, "--json", name, env=environment)
        assert status.returncode == 0, status.stderr
        secret_free(status, SECRET)
    [[user]] = query(
        f"mysql://localhost/lockrun?read_default_file={home}/.my.cnf", "SELECT CURRENT_USER()"
    )
    assert str(user).startswith("secret@")


def test_read_default_file_supplies_the_port_when_the_uri_has_none(
    tcp_server: MariaServer, tmp_path: Path, name: str
) -> None:
    """mysql://127.0.0.1/db?read_default_file= takes the port from the file, as mysql(1) does."""
    cnf = tmp_path / "tcp.cnf"
    cnf.write_text(f"[client]\nuser=secret\npassword={SECRET}\nport={tcp_server.port}\n")
    uri = f"mysql://127.0.0.1/lockrun?read_default_file={cnf}"
    result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "echo", "ran")
    secret_free(result, SECRET)
    assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", "")


# -- F. local files that are not what they claim: configuration errors -----------------------------


def test_a_malformed_option_file_exits_78_in_one_line(tmp_path: Path, name: str) -> None:
    """An option file that does not parse: 78, one line, and none of its contents shown."""
    cnf = tmp_path / "broken.cnf"
    cnf.write_text(f"password={SECRET}\n[client]\nuser=app\n")
    uri = f"mysql://127.0.0.1:{free_port()}/lockrun?read_default_file={cnf}"
    result = lockrun("--uri", uri, "-n", name, "--", "echo", "ran")
    secret_free(result, SECRET)
    line = one_line(result.stderr)
    assert result.returncode == ExitCode.CONFIG
    assert "broken.cnf" in line


def test_unusable_tls_files_exit_78(certificates: Path, name: str) -> None:
    """A key of another certificate: 78 in one line, not the server's failure.

    Each kind of unusable file is refused by `parse`, in process
    (test_parse_refuses_unusable_tls_files): this run is the one end to end.
    """
    query_text = f"ssl_ca={certificates}/ca.crt&ssl_cert={certificates}/client.crt"
    query_text += f"&ssl_key={certificates}/server.key"
    uri = f"mysql://root@127.0.0.1:{free_port()}/lockrun?{query_text}"
    result = lockrun("--uri", uri, "-n", name, "--", "echo", "ran")
    line = one_line(result.stderr)
    assert "does not answer like" not in line
    assert result.returncode == ExitCode.CONFIG


# -- G. TLS ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tls(certificates: Path, name: str) -> None:
    """?ssl_ca= checks the server's certificate and name; a client certificate logs in X509.

    A wrong CA or an address the certificate does not name exits 69, one line. The server
    also listens on 127.0.0.2, which its certificate (IP:127.0.0.1, DNS:localhost) lacks.
    """
    port = free_port()
    server = MariaServer(
        f"--ssl-ca={certificates}/ca.crt",
        f"--ssl-cert={certificates}/server.crt",
        f"--ssl-key={certificates}/server.key",
        "--bind-address=127.0.0.1,127.0.0.2",
        port=port,
    )
    try:
        server.command("CREATE USER x509@'%' REQUIRE X509; GRANT ALL ON lockrun.* TO x509@'%'")
        server.command("CREATE USER x509@localhost REQUIRE X509")
        server.command("GRANT ALL ON lockrun.* TO x509@localhost")
        ca, other = f"ssl_ca={certificates}/ca.crt", f"ssl_ca={certificates}/other-ca.crt"
        client = f"ssl_cert={certificates}/client.crt&ssl_key={certificates}/client.key"
        fence = ("--", "sh", "-c", "echo $LOCKRUN_FENCE")
        for uri in (
            f"mysql://root@127.0.0.1:{port}/lockrun?{ca}",
            f"mysql://root@localhost:{port}/lockrun?{ca}",
            f"mysql://x509@127.0.0.1:{port}/lockrun?{ca}&{client}",
            f"mysql://root@127.0.0.1:{port}/lockrun",  # TLS offered, nothing asked: runs
        ):
            result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, *fence)
            assert result.returncode == 0, (uri, result.stderr)
            assert int(result.stdout) > 0
        for uri, needle in (
            (f"mysql://root@127.0.0.1:{port}/lockrun?{other}", "certificate verify failed"),
            (f"mysql://root@127.0.0.2:{port}/lockrun?{ca}", "mismatch"),
            (f"mysql://x509@127.0.0.1:{port}/lockrun?{ca}", "authentication failed"),
            (f"mysql://x509@127.0.0.1:{port}/lockrun?{other}&{client}", "certificate verify"),
        ):
            # A refusal the server says at once: `lockrun`'s 60 s is the hang guard.
            result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, *fence)
            assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, ""), uri
            line = one_line(result.stderr)
            assert needle in line, line
            assert "does not answer like" not in line
        plain = lockrun("--uri", f"mysql://root@127.0.0.2:{port}/lockrun", "-n", name, "--", "true")
        assert plain.returncode == 0, "the server does not listen on 127.0.0.2"
    finally:
        server.close()


# -- H. Galera -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_galera_node_is_refused_with_78(name: str) -> None:
    """A node with wsrep_on=ON cannot exclude across its cluster: 78, one line, nothing run."""
    if not os.path.exists(GALERA):
        unavailable(f"{GALERA} is not installed")
    server = MariaServer(
        "--wsrep-on=ON",
        f"--wsrep-provider={GALERA}",
        "--wsrep-cluster-address=gcomm://",
        "--binlog-format=ROW",
        "--innodb-autoinc-lock-mode=2",
        f"--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{free_port()}",
        "--wsrep-node-address=127.0.0.1",
    )
    try:
        assert server.command("SHOW VARIABLES LIKE 'wsrep\\_on'").split() == ["wsrep_on", "ON"]
        assert_refused(server.uri, name, ExitCode.CONFIG, "Galera", "wsrep_on=ON")
        assert server.command("SHOW TABLES FROM lockrun") == ""
    finally:
        server.close()


# -- I. a proxy that does not take several statements at once ------------------------------------


class SingleStatements:
    """A loopback forwarder to a MySQL port that hides multi-statements from both ends.

    As a proxy without them does: its greeting does not offer CLIENT_MULTI_STATEMENTS (nor
    TLS, to keep the bytes readable), and the client's answer reaches the server without
    asking for them, so the server takes two statements in one query for bad syntax.
    """

    def __init__(self, port: int) -> None:
        """Listen on a free loopback port and forward each connection to *port*."""
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        """Accept until closed, forwarding each connection in two threads."""
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                threading.Thread(target=self.pipe, args=(server, client, 0), daemon=True).start()
                threading.Thread(target=self.pipe, args=(client, server, 1), daemon=True).start()

    @staticmethod
    def pipe(source: socket.socket, sink: socket.socket, sequence: int) -> None:
        """Copy *source* to *sink*, rewriting the first packet's capability flags."""
        with contextlib.suppress(OSError), source, sink:
            header = source.recv(4, socket.MSG_WAITALL)
            packet = bytearray(
                source.recv(int.from_bytes(header[:3], "little"), socket.MSG_WAITALL)
            )
            assert header[3] == sequence
            if sequence == 0:  # the greeting: version, NUL, id (4), salt (8), filler (1), flags
                low = packet.index(0, 1) + 14
                packet[low + 1] &= ~(CLIENT.SSL >> 8) & 0xFF
                packet[low + 5] &= ~(CLIENT.MULTI_STATEMENTS >> 16) & 0xFF
            else:  # the client's answer: its flags first
                packet[2] &= ~(CLIENT.MULTI_STATEMENTS >> 16) & 0xFF
            sink.sendall(header + packet)
            while data := source.recv(65536):
                sink.sendall(data)

    def close(self) -> None:
        """Stop accepting (open connections end with their clients)."""
        self.listener.close()


def test_a_proxy_without_multi_statements_gets_one_statement_at_a_time(
    tcp_server: MariaServer, held: Callable[..., Held], name: str
) -> None:
    """Fences, semaphores, a refused N and status work through it, a round trip a statement."""
    proxy = SingleStatements(tcp_server.port)
    try:
        uri = f"mysql://root@127.0.0.1:{proxy.port}/lockrun"
        with pytest.raises(pymysql.err.ProgrammingError):  # what a batch would get
            query(uri, "SELECT 1; SELECT 2")
        fences = [held("--uri", uri, "-n", name, "-s", "2").fence for _ in range(2)]
        assert 0 < fences[0] < fences[1]
        refused = lockrun("--uri", uri, "-n", name, "--", "true")
        assert refused.returncode == ExitCode.CONFIG, refused.stderr
        assert "in use with 2 slots" in one_line(refused.stderr)
        busy = lockrun("--uri", uri, "-n", name, "-s", "2", "--", "true")
        assert busy.returncode == ExitCode.BUSY, busy.stderr
        [state] = json.loads(lockrun("status", "--uri", uri, "--json", name).stdout)
        assert sorted(owner["slot"] for owner in state["holders"]) == [0, 1]
    finally:
        proxy.close()
