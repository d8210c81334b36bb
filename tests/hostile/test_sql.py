"""Names, namespaces and holder records written like SQL: MySQL and MariaDB store them as data.

lockrun sends several statements in one round trip to MySQL (docs/design.md A7), so a value
that left its quotes could run statements of its own. Every value goes as a parameter, which
the driver escapes for the connection's character set and the server's sql_mode. The oracle
is the server: no table the inputs name appears, status gives each input back unchanged, and
fences keep rising.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from subprocess import PIPE
from typing import TYPE_CHECKING, Final

import pymysql
import pytest

from lockrun import ConfigError
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.timing import now
from tests.support.cli import lockrun
from tests.support.net import mysql_query as query
from tests.support.servers import MariaServer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from subprocess import Popen

# Each would create this table if the server ran it as a statement.
MARK: Final = "lockrun_injected"
PAYLOADS: Final = (
    f"x'; CREATE TABLE {MARK} (i INT); -- ",
    f'x"; CREATE TABLE {MARK} (i INT); #',
    f"x\\'; CREATE TABLE {MARK} (i INT); /*",
    f"x\\\\'); CREATE TABLE {MARK} (i INT); SELECT ('",
    f"*/; CREATE TABLE {MARK} (i INT); /*",
    f"/*!50000 CREATE TABLE {MARK} (i INT) */",
    f"x`; CREATE TABLE {MARK} (i INT); -- `",
    f"''; CREATE TABLE {MARK} (i INT); SELECT ''",
    "%s %(x)s %% {0} ? ?",
    "\\",
    "x\\",
    "\x1a\r\n\t\b;",
    f"\u02bc; CREATE TABLE {MARK} (i INT); -- ",  # modifier letter apostrophe
    f"\uff07; CREATE TABLE {MARK} (i INT); -- ",  # fullwidth apostrophe
    f"\U0001f512'; CREATE TABLE {MARK} (i INT); -- ",
)
# For each charset: a character whose second byte is 0x5C (a backslash), then a quote.
CHARSETS: Final = {
    "utf8mb4": "",
    "latin1": "\xff'\\",
    "gbk": "\u7e17'",
    "big5": "\u529f'",
    "cp932": "\u30bd'",
    "sjis": "\u30bd'",
}
# MySQL's sjis reads byte 0x5C as a YEN SIGN and sends a backslash back as U+FF3C, so a JSON
# record with a backslash (or a \\u escape) does not read back: status shows the session.
GARBLED: Final = frozenset({"sjis"})


def with_charset(uri: str, charset: str) -> str:
    """Return *uri* with ``charset=`` *charset* added to its query."""
    return f"{uri}{'&' if '?' in uri else '?'}charset={charset}"


def payloads(charset: str) -> list[str]:
    """Return the payloads the connection's character set can carry, and its own."""
    encoding = pymysql.charset.charset_by_name(charset).encoding
    chosen = [*PAYLOADS, CHARSETS[charset]] if CHARSETS[charset] else list(PAYLOADS)
    fitting = []
    for payload in chosen:
        with contextlib.suppress(UnicodeEncodeError):
            payload.encode(encoding)
            fitting.append(payload)
    return fitting


def injected(uri: str) -> bool:
    """Whether a statement of the payloads ran: their table exists."""
    rows = query(
        uri, "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_NAME = %s", (MARK,)
    )
    return bool(rows[0][0])


def check_round_trips(uri: str, charset: str) -> None:
    """Hold, re-hold, refuse and read back every payload as name, namespace and record."""
    backend = open_backend(parse_uri(with_charset(uri, charset)), ttl=10.0)
    try:
        for payload in payloads(charset):
            unique = uuid.uuid4().hex[:8]
            namespace, name = f"{payload}{unique}", f"{unique}{payload}"
            holder = Holder(payload, 4242, f"u{payload}", (payload, "--", payload))
            for slots in (1, 3):
                request = Request(namespace, f"{name}{slots}", slots, 10.0, holder)
                fences = []
                for _ in range(2):
                    lease = backend.acquire(request, now())
                    assert lease is not None, (charset, payload)
                    fences.append(lease.fence)
                    [state] = backend.status(namespace, request.name)
                    [shown] = state.holders
                    assert (state.namespace, state.name) == (namespace, request.name)
                    if charset not in GARBLED:
                        assert (shown.host, shown.pid, shown.user, shown.argv) == holder[:4]
                    assert state.slots == slots
                    by = "" if charset in GARBLED else f"by u{payload}@"
                    with pytest.raises(ConfigError, match=f"in use with.*{re.escape(by)}"):
                        backend.acquire(request._replace(slots=slots + 1), now())
                    lease.release()
                assert fences[0] is not None
                assert fences[1] is not None
                assert fences[1] > fences[0]
            listed = {state.name for state in backend.status(namespace, None)}
            assert listed <= {f"{name}1", f"{name}3"}
    finally:
        backend.close()
    assert not injected(uri), charset


@pytest.mark.parametrize("charset", sorted(CHARSETS))
def test_sql_in_names_and_records_is_stored_as_data(mysql_uri: str, charset: str) -> None:
    """Quotes, backslashes, comments and 0x5C trailing bytes: data, in every charset."""
    check_round_trips(mysql_uri, charset)


@pytest.fixture(scope="module")
def literal_server() -> Iterator[MariaServer]:
    """Return a MariaDB whose sql_mode takes backslashes literally and quotes as names."""
    server = MariaServer("--sql-mode=NO_BACKSLASH_ESCAPES,ANSI_QUOTES")
    yield server
    server.close()


@pytest.mark.parametrize("charset", ["utf8mb4", "gbk"])
def test_sql_in_names_is_data_where_backslashes_are_literal(
    literal_server: MariaServer, charset: str
) -> None:
    """NO_BACKSLASH_ESCAPES and ANSI_QUOTES: the same inputs stay data, fences rise."""
    check_round_trips(literal_server.uri, charset)


def test_sql_in_a_command_line_and_name_reaches_status_unchanged(
    mysql_uri: str, spawn: Callable[..., Popen[str]]
) -> None:
    """The CLI records a command line, a name and a namespace written like SQL, as written."""
    for payload in PAYLOADS[:8]:
        name = f"{uuid.uuid4().hex[:8]}{payload}"
        argv = ["sh", "-c", 'echo "$LOCKRUN_FENCE"; read _', payload]
        options = ("--uri", mysql_uri, "--namespace", payload, "-n", name)
        holder = spawn(*options, "--", *argv, stdin=PIPE, stdout=PIPE)
        assert holder.stdout is not None
        assert int(holder.stdout.readline()) > 0
        shown = lockrun("status", "--uri", mysql_uri, "--namespace", payload, "--json", name)
        assert shown.returncode == 0, shown.stderr
        [state] = json.loads(shown.stdout)
        [owner] = state["holders"]
        assert (state["namespace"], state["name"], owner["argv"]) == (payload, name, argv)
        assert holder.communicate("\n", timeout=30) == ("", "")
        assert holder.returncode == 0
    assert not injected(mysql_uri)


@pytest.mark.parametrize("charset", ["latin1", "ascii", "sjis", "gbk"])
@pytest.mark.parametrize("where", ["name", "namespace"])
def test_a_name_the_charset_cannot_carry_is_refused_with_78(
    mysql_uri: str, charset: str, where: str
) -> None:
    """A name or namespace the URI's charset has no bytes for: 78, one line; it was 70.

    Run and status alike; nothing is held and no row is written.
    """
    text = f"t-{uuid.uuid4().hex[:8]}-\u540d\u20ac\U0001f512"  # 名€🔒: none of them has all
    uri = f"{mysql_uri}{'&' if '?' in mysql_uri else '?'}charset={charset}"
    names = ["-n", text] if where == "name" else ["-n", "x", "--namespace", text]
    for args in (
        ("--uri", uri, *names, "--", "echo", "ran"),
        ("status", "--uri", uri, *names[2:], *([text] if where == "name" else [])),
    ):
        result = lockrun(*args)
        assert (result.returncode, result.stdout) == (78, ""), (args, result.stderr)
        assert f"charset {charset} cannot carry the name" in result.stderr
        assert len(result.stderr.splitlines()) == 1
    with pytest.raises(ConfigError, match="cannot carry"):
        open_backend(parse_uri(uri)).acquire(
            Request("default" if where == "name" else text, text, 1, 30.0, Holder.me(["x"])),
            now(),
        )


@pytest.mark.parametrize("charset", ["utf8mb4", "gbk"])
def test_sql_in_names_and_records_is_data_in_every_mode(mysql_uri: str, charset: str) -> None:
    """Shared holders, hold windows and take-overs write names and records as data too.

    Each goes into lockrun_marks (docs/design.md A7) and comes back unchanged in status.
    """
    backend = open_backend(parse_uri(with_charset(mysql_uri, charset)), ttl=10.0)
    try:
        for payload in payloads(charset):
            unique = uuid.uuid4().hex[:8]
            namespace, name = f"{payload}{unique}", f"{unique}{payload}"
            holder = Holder(payload, 4242, f"u{payload}", (payload, "--", payload))
            shared = Request(namespace, name, 1, 10.0, holder._replace(shared=True), shared=True)
            lease = backend.acquire(shared, now())
            assert lease is not None, (charset, payload)
            [state] = backend.status(namespace, name)
            [shown] = state.holders
            assert shown.shared
            if charset not in GARBLED:
                assert (shown.host, shown.user, shown.argv) == (payload, f"u{payload}", holder.argv)
            lease.release()
            taker = Request(namespace, name, 1, 10.0, holder, take_over=True)
            lease = backend.acquire(taker, now() + 5)
            assert lease is not None, (charset, payload)
            lease.release(hold=30)
            [state] = backend.status(namespace, name)
            [shown] = state.holders
            assert shown.until is not None
            assert (shown.host, shown.user) == (payload, f"u{payload}")
            assert backend.acquire(taker._replace(take_over=False), now()) is None  # the window
            assert {state.name for state in backend.status(namespace, None)} == {name}
    finally:
        backend.close()
    assert not injected(mysql_uri), charset
