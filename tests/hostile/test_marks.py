"""MySQL's lockrun_marks and stop lock written by another client: read as untrusted.

A co-tenant of the server may write rows of lockrun_marks (hold windows, shared holders,
take-over requests) and hold any GET_LOCK name, KEY:stop included. That is the power to
keep a lock busy, as holding it is; it must never make lockrun exit 70, print a traceback,
or wait past what a hold can be (docs/design.md A7). The oracles are exit statuses, the one
line, the time taken and what status prints.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import pymysql
import pytest

from lockrun.backends import parse_uri
from lockrun.backends.mysql import MARKS, lock_key
from lockrun.backends.mysql import parse as mysql_parse
from lockrun.bounds import MAX_WAIT
from tests.support.cli import Held, lock_state, lockrun, one_line, statuses_read, wait_for
from tests.support.net import mysql_query as query
from tests.support.strategies import deep

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.servers import MariaServer

TTL = "5"
ROW = (
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "  # noqa: S608 - our table
    "VALUES (%s, %s, %s, %s, 'default', %s, %s)"
)
NOW_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"


def clean(result: Any, *statuses: int) -> None:
    """Assert a run ended with one of *statuses*, one line if lockrun spoke, no traceback."""
    assert result.returncode in statuses, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    if result.stderr:
        one_line(result.stderr)


@pytest.fixture
def foreign(mysql_uri: str) -> Iterator[pymysql.Connection[Any]]:
    """Return a connection of a co-tenant of the session's server."""
    connection = pymysql.connect(**mysql_parse(parse_uri(mysql_uri)).kwargs, autocommit=True)
    yield connection
    if connection.open:
        connection.close()


def make_tables(uri: str, name: str) -> None:
    """Have lockrun make its tables, lockrun_marks included."""
    shared = lockrun("--uri", uri, "-n", f"{name}-tables", "--shared", "--", "true")
    assert shared.returncode == 0, shared.stderr


# -- forged rows ----------------------------------------------------------------------------


def test_a_forged_window_far_ahead_is_busy_for_a_year_at_most(mysql_uri: str, name: str) -> None:
    """until_us of the year 146 000: busy at once for a waiter of 1 s, status shows ≤ a year."""
    make_tables(mysql_uri, name)
    key = lock_key("default", name)
    record = json.dumps({"host": "forged", "pid": 1, "user": "mallory"})
    query(mysql_uri, ROW, (key, "hold", 1, 2**62, name, record))
    # One that waited for the window would never end: `lockrun`'s 60 s is the hang guard.
    busy = lockrun("--uri", mysql_uri, "-n", name, "-w", "1", "--", "true")
    clean(busy, 75)
    assert "mallory@forged" in busy.stderr
    (holder,) = lock_state(mysql_uri, name)["holders"]
    assert holder["until"] <= time.time() + MAX_WAIT + 60
    statuses_read(mysql_uri, name)


# One row per kind of forgery, each end to end: a window at the server's arithmetic's
# edge, a dead reader with a junk record (swept), a stop row nobody holds the lock of, and a
# mark too long for GET_LOCK's name. What the decoder makes of any row, and of each of
# these, is tests/unit/test_mysql_rows.py's.
@pytest.mark.parametrize(
    ("mark", "until", "record"),
    [
        ("hold", 2**63 - 1, deep(30_000)),
        ("r:0123456789abcdef", 0, '{"pid": "x", "host": [], "user": null}'),
        ("stop", 2**62, "*/ SELECT 1 /*"),
        ("r:0123456789abcdef0123", 0, "{}"),
    ],
    ids=["hold-max", "reader-types", "stop", "reader-long"],
)
def test_forged_rows_change_no_decision(
    mysql_uri: str, name: str, mark: str, until: int, record: str
) -> None:
    """Rows nobody holds a lock for, junk records, extreme times: runs go on, status reads."""
    make_tables(mysql_uri, name)
    key = lock_key("default", name)
    query(mysql_uri, ROW, (key, mark, 424242, until, name, record))
    for mode in ((), ("--shared",), ("--hold-at-least", "0.1"), ("--take-over", "-w", "5")):
        clean(lockrun("--uri", mysql_uri, "-n", name, *mode, "--", "true"), 0, 75)
    statuses_read(mysql_uri, name)
    assert query(mysql_uri, "SELECT COUNT(*) FROM lockrun_holders") != ()  # the tables stand


def test_a_forged_live_shared_holder_is_a_holder_not_a_crash(
    mysql_uri: str, name: str, foreign: pymysql.Connection[Any]
) -> None:
    """A co-tenant holds a reader's lock and row: writers wait (busy), readers share, no 70."""
    make_tables(mysql_uri, name)
    key = lock_key("default", name)
    mark = "r:00000000deadbeef"
    with foreign.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, 0), CONNECTION_ID()", (f"{key}:{mark}",))
        got, connection = cursor.fetchone()
    assert got == 1
    query(mysql_uri, ROW, (key, mark, connection, 0, name, '{"pid": -1}'))
    # The co-tenant holds on for ever: `lockrun`'s 60 s guards a writer that would wait it out.
    clean(lockrun("--uri", mysql_uri, "-n", name, "-w", "1", "--", "true"), 75)
    clean(lockrun("--uri", mysql_uri, "-n", name, "--shared", "--", "true"), 0)
    (holder,) = lock_state(mysql_uri, name)["holders"]
    assert holder["shared"] is True
    assert f"connection {connection}" in holder["host"]
    statuses_read(mysql_uri, name)


def test_a_stop_lock_held_by_a_stranger_stops_holders_and_never_hangs(
    mysql_uri: str,
    name: str,
    foreign: pymysql.Connection[Any],
    held: Callable[..., Held],
) -> None:
    """KEY:stop held by a session with no row: holders exit 79 naming it; tries are busy."""
    holder = held("--uri", mysql_uri, "-n", name, "--ttl", TTL)
    with foreign.cursor() as cursor:
        cursor.execute(
            "SELECT GET_LOCK(%s, 0), CONNECTION_ID()", (f"{lock_key('default', name)}:stop",)
        )
        got, connection = cursor.fetchone()
    assert got == 1
    assert holder.process.wait(30) == 79
    _, err = holder.process.communicate()
    assert one_line(err).endswith(f"(connection {connection})")
    clean(lockrun("--uri", mysql_uri, "-n", name, "--", "true"), 75)
    # A waiter gives way at once: one that waited its hour out would fail `lockrun`'s 60 s.
    clean(lockrun("--uri", mysql_uri, "-n", name, "-w", "3600", "--", "true"), 79)
    clean(lockrun("--uri", mysql_uri, "-n", name, "--take-over", "-w", "1", "--", "true"), 75)
    statuses_read(mysql_uri, name)
    foreign.close()
    wait_for(lambda: lockrun("--uri", mysql_uri, "-n", name, "--", "true").returncode == 0)


@pytest.mark.slow
def test_a_table_of_marks_with_the_wrong_types_breaks_nothing(
    maria_server: MariaServer, name: str
) -> None:
    """Columns altered to text and NULL, rows of junk in them: no 70, no traceback, status reads."""
    uri = maria_server.uri
    make_tables(uri, name)
    maria_server.command(
        "ALTER TABLE lockrun.lockrun_marks MODIFY until_us VARCHAR(64) NULL, "
        "MODIFY connection_id VARCHAR(64) NULL, MODIFY holder BLOB NULL"
    )
    key = lock_key("default", name)
    rows = [
        ("hold", "abc", "1e30"),
        ("r:0123456789abcdef", None, None),
        ("r:aaaaaaaaaaaaaaaa", "-1", "99999999999999999999999999"),
    ]
    for mark, connection, until in rows:
        with contextlib.suppress(pymysql.err.Error):  # what the server takes, it keeps
            query(uri, ROW, (key, mark, connection, until, name, None))
    for mode in ((), ("--shared",), ("--hold-at-least", "0.1"), ("--take-over", "-w", "5")):
        result = lockrun("--uri", uri, "-n", name, "-w", "2", *mode, "--", "true")
        assert result.returncode != 70, result.stderr
        assert "Traceback" not in result.stderr
    statuses_read(uri, name)
    # lockrun's own window, written into the altered table, still counts.
    assert lockrun("--uri", uri, "-n", name, "--hold-at-least", "30", "--", "true").returncode == 0
    clean(lockrun("--uri", uri, "-n", name, "--", "true"), 75)
    assert query(uri, f"SELECT COUNT(*) FROM {MARKS} WHERE until_us > {NOW_US}")  # noqa: S608
