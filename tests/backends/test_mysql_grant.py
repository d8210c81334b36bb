"""What a grant costs on MySQL/MariaDB, counted by servers of the tests' own (issue #32).

A kept lock's cycle is the try with the grant in one round trip, then the release; the
fence and the record live in MEMORY tables, so no grant waits for InnoDB to flush. The
oracles are the server's own: its general log (one row per query, however many
statements it holds) and its status counters. Nobody else uses these servers.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from typing import TYPE_CHECKING

import pymysql
import pytest
from pymysql.constants import ER

from lockrun import ConfigError, Lock
from lockrun.backends import parse_uri
from lockrun.backends.mysql import FENCES, HOLDERS, lock_key
from lockrun.backends.mysql import parse as mysql_parse
from tests.support.cli import lockrun
from tests.support.net import mysql_query as query
from tests.support.servers import MariaServer

if TYPE_CHECKING:
    from collections.abc import Iterator

CYCLES = 50
WAITING_NOW = (  # a lockrun waiter in GET_LOCK's queue
    "SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT GET\\_LOCK(%lockrun%'"
)
# The tables of a lockrun before issue #32: InnoDB, the record in a TEXT column.
INNODB_TABLES = (
    f"""CREATE TABLE {FENCES} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
      fence BIGINT UNSIGNED NOT NULL
    ) ENGINE=InnoDB""",
    f"""CREATE TABLE {HOLDERS} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      slot INT UNSIGNED NOT NULL,
      slots INT UNSIGNED NOT NULL,
      connection_id BIGINT UNSIGNED NOT NULL,
      namespace VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      holder TEXT CHARACTER SET utf8mb4 NOT NULL,
      PRIMARY KEY (lock_key, slot)
    ) ENGINE=InnoDB""",
)


@pytest.fixture(scope="module")
def server() -> Iterator[MariaServer]:
    """Return a MariaDB of this module's own, durable as MariaDB ships (a flush per commit)."""
    server = MariaServer("--innodb-flush-log-at-trx-commit=1")
    yield server
    server.close()


def counters(server: MariaServer) -> dict[str, int]:
    """Return the server's InnoDB fsync counters."""
    rows = server.command(
        "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_data_fsyncs', 'Innodb_os_log_fsyncs')"
    )
    return {name: int(value) for name, value in (line.split("\t") for line in rows.splitlines())}


def fenced(fence: int | None) -> int:
    """Return *fence*, which a grant with the tables always has."""
    assert isinstance(fence, int)
    return fence


def statements(query: str) -> int:
    """Return how many statements *query* holds: its semicolons outside quoted strings."""
    count, quote, escaped = 1, "", False
    for char in query:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = bool(quote)
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == ";":
            count += 1
    return count


def logged(server: MariaServer, pattern: str) -> list[tuple[int, str]]:
    """Return (thread, query) of the general log's queries of sessions that sent *pattern*.

    *pattern* is LIKE's; the queries come in the order the server logged them.
    """
    rows = query(
        server.uri,
        "SELECT thread_id, argument FROM mysql.general_log WHERE command_type = 'Query' "
        "AND thread_id IN (SELECT thread_id FROM mysql.general_log WHERE argument LIKE %s) "
        "ORDER BY event_time",
        (pattern,),
    )
    server.command("TRUNCATE mysql.general_log")
    return [
        (int(thread), text if isinstance(text, str) else text.decode()) for thread, text in rows
    ]


def test_a_kept_lock_cycles_in_two_round_trips_and_flushes_nothing(
    server: MariaServer, name: str
) -> None:
    """N cycles of one kept Lock: 2N queries on its session, and no InnoDB fsync per grant.

    The try carries the grant (fence, record, checks, marks); the release is the other.
    Before issue #32 it was 3N queries and an fsync per grant. The try's query is six
    statements: the try, the transaction of fence and record, and one read (it was eight).
    """
    lock = Lock(name, uri=server.uri, wait=None)
    fences: list[int] = []
    for _ in range(3):  # connects, makes the tables
        with lock as lease:
            fences.append(fenced(lease.fence))
    server.command("SET GLOBAL log_output = 'TABLE', general_log = 1")
    try:
        before = counters(server)
        for _ in range(CYCLES):
            with lock as lease:
                fences.append(fenced(lease.fence))
        after = counters(server)
    finally:
        server.command("SET GLOBAL general_log = 0")
    trips = [query for _, query in logged(server, "SELECT GET\\_LOCK%")]
    assert len(trips) == 2 * CYCLES
    tries = [query for query in trips if query.startswith("SELECT GET_LOCK")]
    assert len(tries) == CYCLES
    assert {statements(query) for query in tries} == {6}
    for counter, count in after.items():
        assert count - before[counter] < CYCLES / 5, counter
    assert fences == sorted(set(fences))  # each larger than the one before


def test_a_queued_waiter_is_granted_in_the_round_trip_of_its_wait(
    server: MariaServer, name: str
) -> None:
    """A waiter that found the lock busy: its try, its wait with the grant, its release.

    The try's read is the check of N, and the grant rides in the wait's query: three
    queries, where there were five (a second try with the check, and the grant apart).
    """
    with Lock(name, uri=server.uri, wait=None):
        pass  # the tables, made
    holder = Lock(name, uri=server.uri, wait=None)
    waiter = Lock(name, uri=server.uri, wait=None)
    fences: list[int] = []

    def wait() -> None:
        with waiter as lease:
            fences.append(fenced(lease.fence))

    server.command("SET GLOBAL log_output = 'TABLE', general_log = 1")
    try:
        with holder as held:
            thread = threading.Thread(target=wait)
            thread.start()
            while not query(server.uri, WAITING_NOW):
                time.sleep(0.01)
        thread.join(timeout=60)
    finally:
        server.command("SET GLOBAL general_log = 0")
    sent = logged(server, "SELECT GET\\_LOCK(%, 31536000.000) /* lockrun%")
    queries = [text for _, text in sent if not text.startswith(("SET ", "SHOW "))]
    assert len({thread for thread, _ in sent}) == 1
    assert [text.split("(", 1)[0] for text in queries] == [
        "SELECT GET_LOCK",
        "SELECT GET_LOCK",
        "SELECT RELEASE_LOCK",
    ]
    assert fences[0] > fenced(held.fence)


def test_a_queued_waiter_is_recorded_since_its_grant_not_since_it_began_to_wait(
    server: MariaServer, name: str
) -> None:
    """`status` names the waiter granted in its wait's query as holding since the grant."""
    holder = Lock(name, uri=server.uri, wait=None)
    waiter = Lock(name, uri=server.uri, wait=None)
    held = threading.Event()
    done = threading.Event()

    def wait() -> None:
        with waiter:
            held.set()
            done.wait(60)

    with holder:
        thread = threading.Thread(target=wait)
        thread.start()
        while not query(server.uri, WAITING_NOW):
            time.sleep(0.01)
        time.sleep(1)  # the waiter's record, had it been written when it began to wait
        released = time.time()
    try:
        assert held.wait(60)
        [state] = json.loads(lockrun("status", "--uri", server.uri, "--json", name).stdout)
        [record] = state["holders"]
        assert record["since"] >= released - 0.5
    finally:
        done.set()
        thread.join(60)


def test_a_run_sets_its_session_up_and_checks_the_server_in_one_round_trip(
    server: MariaServer, name: str
) -> None:
    """`lockrun -- true`: the session's settings with the Galera check, the try, the release.

    Three queries on its session; PyMySQL's SET NAMES, the settings and the check were
    three of their own.
    """
    assert lockrun("--uri", server.uri, "-n", name, "--", "true").returncode == 0  # the tables
    server.command("SET GLOBAL log_output = 'TABLE', general_log = 1")
    try:
        assert lockrun("--uri", server.uri, "-n", name, "--", "true").returncode == 0
    finally:
        server.command("SET GLOBAL general_log = 0")
    queries = [text[:40] for _, text in logged(server, "SELECT GET\\_LOCK%")]
    assert [text.split(" ", 1)[0] for text in queries] == ["SET", "SELECT", "SELECT"], queries


def test_a_fence_keeps_growing_when_a_restart_empties_its_table(name: str) -> None:
    """The fence is in memory: a restart forgets it, and the clock seeds a larger one."""
    server = MariaServer()
    try:
        fence = "echo $LOCKRUN_FENCE"
        first = lockrun("--uri", server.uri, "-n", name, "--", "sh", "-c", fence)
        assert first.returncode == 0, first.stderr
        server.restart()
        key = lock_key("default", name)
        assert (
            query(server.uri, "SELECT fence FROM lockrun_fence WHERE lock_key = %s", (key,)) == ()
        )
        second = lockrun("--uri", server.uri, "-n", name, "--", "sh", "-c", fence)
        assert second.returncode == 0, second.stderr
        assert int(second.stdout) > int(first.stdout)
    finally:
        server.close()


def test_tables_an_earlier_lockrun_made_in_innodb_keep_working(
    server: MariaServer, name: str
) -> None:
    """InnoDB tables of before: fences grow, status names the holder, another N is 78."""
    server.command("CREATE DATABASE innodb_era")
    for statement in INNODB_TABLES:
        server.command(f"USE innodb_era; {statement}")
    uri = server.uri.replace("/lockrun?", "/innodb_era?")
    lock = Lock(name, uri=uri, wait=None)
    fences: list[int] = []
    for _ in range(3):
        with lock as lease:
            fences.append(fenced(lease.fence))
            [state] = json.loads(lockrun("status", "--uri", uri, "--json", name).stdout)
            assert [holder["pid"] for holder in state["holders"]] == [os.getpid()]
            with (
                pytest.raises(ConfigError, match="in use with 1 slot"),
                Lock(name, uri=uri, slots=2, wait=0),
            ):
                pass
    assert fences == sorted(set(fences))
    engines = server.command(
        "SELECT DISTINCT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = 'innodb_era'"
    )
    assert engines == "InnoDB"


def fill(uri: str, table: str, row: str) -> int:
    """Insert *row* (``@n`` numbers it) into *table* until the server says it is full."""
    connection = pymysql.connect(**mysql_parse(parse_uri(uri)).kwargs, autocommit=True)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET @n = 0")
            for count in itertools.count():
                try:
                    cursor.execute("SET @n = @n + 1")
                    cursor.execute(f"INSERT INTO {table} {row}")
                except pymysql.err.OperationalError as err:
                    if err.args[0] != ER.RECORD_FILE_FULL:
                        raise
                    return count
    finally:
        connection.close()
    return 0


def test_full_tables_in_memory_are_swept_of_what_no_longer_counts(name: str) -> None:
    """Tables at max_heap_table_size, full of dead records and day-old fences: a grant gets in.

    The sweep keeps a recent fence.
    """
    server = MariaServer("--max-heap-table-size=65536")
    try:
        live = f"{name}-live"
        assert lockrun("--uri", server.uri, "-n", live, "--", "true").returncode == 0
        day_old = "CAST(UNIX_TIMESTAMP(NOW(6) - INTERVAL 2 DAY) * 1000000 AS UNSIGNED)"
        assert fill(server.uri, FENCES, f"VALUES (CONCAT('x', @n), {day_old})") > 1
        assert fill(server.uri, HOLDERS, "VALUES (CONCAT('x', @n), 0, 1, 1, 'a', 'b', '{}')") > 1
        fence = "echo $LOCKRUN_FENCE"
        result = lockrun("--uri", server.uri, "-n", name, "--", "sh", "-c", fence)
        assert result.returncode == 0, result.stderr
        assert int(result.stdout) > 0
        key = lock_key("default", live)
        count = "SELECT COUNT(*) FROM lockrun_fence WHERE lock_key = %s"
        assert query(server.uri, count, (key,)) == ((1,),)
    finally:
        server.close()
