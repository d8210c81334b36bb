"""Forged windows and stop keys on PostgreSQL: what another client may write, read as untrusted.

lockrun_holds is granted to PUBLIC and anyone may take any advisory key, so another role can
forge a --hold-at-least window, make the table before lockrun does (any shape), or hold a
name's stop key. Whatever they do: never a traceback or exit 70, one line, status reads,
and nothing held for ever (a window read back ends within 366 days; a waiter's deadline
holds). A forged window may make a lock busy: that is no more than holding it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.postgres import WINDOWS, lock_key
from lockrun.backends.postgres.keys import Keys, channel
from lockrun.bounds import MAX_WAIT
from lockrun.errors import ExitCode
from lockrun.timing import now
from tests.support.cli import clean, lock_state, lockrun, one_line, start, statuses_read, wait_for
from tests.support.net import postgres_query as query

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.cli import Held
    from tests.support.servers import PostgresServer

SLACK = 3.0
PASSWORD = "pw-for-mallory"  # noqa: S105 - the throwaway server's
# Statements another client might leave in a row, as data: none may run.
MARK = "lockrun_injected"
SQL_ISH = (
    f"x'); CREATE TABLE {MARK} (i int); --",
    f"*/ CREATE TABLE {MARK} (i int); /*",
    f"$$; CREATE TABLE {MARK} (i int); $$",
)


def run(uri: str, name: str, *options: str) -> Any:
    """Run ``lockrun --uri URI -n NAME OPTIONS -- true``."""
    return lockrun("--uri", uri, "-n", name, *options, "--", "true")


@pytest.fixture
def mallory(pg_server: PostgresServer) -> Iterator[psycopg.Connection[Any]]:
    """Return a connection of a role of no privilege but PUBLIC's, on the test's own server."""
    pg_server.command(f"CREATE ROLE mallory LOGIN PASSWORD '{PASSWORD}'")
    uri = (
        f"postgresql://mallory:{PASSWORD}@/lockrun?host={pg_server.directory}&port={pg_server.port}"
    )
    with psycopg.connect(uri, autocommit=True) as connection:
        yield connection


def made_by_lockrun(uri: str) -> None:
    """Have lockrun make lockrun_holds, as its first --hold-at-least does."""
    assert run(uri, f"maker-{uuid.uuid4().hex[:8]}", "--hold-at-least", "0.1").returncode == 0


# One record per defect class: another lock's good record (shown as "?"), one too large for a
# row of status (cut by the server), and SQL that would close the comment. The rest of the
# forged values are decoded in-process: tests/unit/test_postgres_rows.py.
FORGED_HOLDER = (
    json.dumps({"token": "t", "namespace": "default", "name": "another", "slots": 1,
                "holder": {"host": "h", "pid": 1, "user": "u"}}),
    "x" * 1_000_000,
    SQL_ISH[1],
)  # fmt: skip


def test_a_forged_window_is_busy_for_at_most_366_days(
    pg_server: PostgresServer, mallory: psycopg.Connection[Any], name: str
) -> None:
    """A window forged by another role, for ever: busy (75), one line, cut at 366 days."""
    made_by_lockrun(pg_server.uri)
    for index, holder in enumerate(FORGED_HOLDER):
        lock = f"{name}-{index}"
        mallory.execute(
            f"INSERT INTO {WINDOWS} VALUES (%s, 'infinity'::timestamptz, %s)",  # noqa: S608
            (lock_key("default", lock, 0), holder),
        )
        # Every window is an hour or more: a waiter that waited it out would fail `lockrun`'s
        # 60 s (the hang guard), so 75 is the wait's end, however loaded the machine.
        busy = run(pg_server.uri, lock, "-w", "1")
        clean(busy, ExitCode.BUSY)
        assert "--hold-at-least" in busy.stderr
        [shown] = lock_state(pg_server.uri, lock)["holders"]
        assert time.time() < shown["until"] <= time.time() + MAX_WAIT + SLACK
        if holder.startswith('{"token": "t"'):  # a good record, of another lock: not shown
            assert (shown["user"], shown["pid"]) == ("?", 0)
    # Every form of status, once all the forged windows are there: the listings show them all.
    statuses_read(pg_server.uri, f"{name}-0")
    assert pg_server.command(f"SELECT to_regclass('{MARK}') IS NULL") == "t"


def test_a_table_of_another_shape_is_warned_about_and_refuses_holds(
    pg_server: PostgresServer, name: str
) -> None:
    """lockrun_holds made first by someone else, of other columns: runs warn, holds are 78."""
    pg_server.command(f"CREATE TABLE {WINDOWS} (key text, until text, holder int)")
    pg_server.command(f"INSERT INTO {WINDOWS} VALUES ('x', 'tomorrow', 7)")  # noqa: S608
    result = run(pg_server.uri, name)
    assert result.returncode == 0
    assert f"table {WINDOWS} cannot be read" in one_line(result.stderr)
    held = lockrun("--uri", pg_server.uri, "-n", name, "-q", "--hold-at-least", "5", "--", "true")
    assert held.returncode == ExitCode.CONFIG
    assert f"needs table {WINDOWS}" in held.stderr.splitlines()[-1]
    assert "Traceback" not in held.stderr
    clean(run(pg_server.uri, name, "-w", "0"), 0)  # the refused hold left the lock free
    statuses_read(pg_server.uri, name)


def test_null_and_odd_rows_in_a_table_without_constraints(
    pg_server: PostgresServer, name: str
) -> None:
    """Made first without NOT NULL or a key: NULL ends are no window, a NULL holder is '?'."""
    pg_server.command(f"CREATE TABLE {WINDOWS} (key bigint, until timestamptz, holder text)")
    key = lock_key("default", name, 0)
    pg_server.command(
        f"INSERT INTO {WINDOWS} VALUES ({key}, NULL, 'x'), ({key}, '-infinity', NULL), "  # noqa: S608
        f"(NULL, 'infinity', NULL)"
    )
    clean(run(pg_server.uri, name, "-w", "0"), 0)
    statuses_read(pg_server.uri, name)
    pg_server.command(
        f"INSERT INTO {WINDOWS} VALUES ({key}, now() + interval '1 hour', NULL)"  # noqa: S608
    )
    busy = run(pg_server.uri, name, "-w", "0")
    clean(busy, ExitCode.BUSY)
    assert "?@lockrun_holds pid 0" in busy.stderr


def test_a_stop_key_held_by_a_session_that_does_not_wait_stops_nobody(
    postgres_uri: str, held: Callable[..., Held], name: str
) -> None:
    """Someone holds the stop key, exclusively even, and waits for nothing: no take-over."""
    with psycopg.connect(postgres_uri, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (lock_key("default", name, "stop"),))
        holder = held("--uri", postgres_uri, "-n", name)
        time.sleep(2)  # past a check of the holder's (ttl 5 from the fixture's environment)
        assert holder.process.poll() is None
        # A taker cannot take the stop key beside an exclusive holder: it waits as any.
        taker = run(postgres_uri, name, "--take-over", "-w", "1")
        clean(taker, ExitCode.BUSY)
        assert holder.finish() == 0
        clean(run(postgres_uri, name), 0)


@pytest.mark.parametrize(
    "comment",
    ["", "/* lockrun {junk} */", '/* lockrun {"token": "t", "slots": 1} */'],
    ids=["bare", "junk", "no-holder"],
)
def test_a_forged_taker_is_obeyed_and_named_in_one_line(
    postgres_uri: str, name: str, comment: str
) -> None:
    """A session that holds the stop key, says so and waits is a take-over, whoever: 79, one line.

    That is what any lockrun could ask; the holder names what the server says of it.
    """
    keys = Keys("default", name, 1)
    holder = start("--uri", postgres_uri, "-n", name, "--", "sleep", "60")
    with psycopg.connect(postgres_uri, autocommit=True) as other:
        wait_for(lambda: lock_state(postgres_uri, name)["holders"], what="the holder")
        other.execute("SELECT pg_advisory_lock_shared(%s)", (keys.stop,))
        other.execute("SELECT pg_notify(%s, '')", (channel(keys),))
        waits = threading.Thread(
            target=other.execute, args=(f"{comment} SELECT pg_advisory_lock({keys.slots[0]})",)
        )
        waits.start()  # the same session now waits for slot 0: a take-over, as asked
        _, said = holder.communicate(timeout=30)
        waits.join(30)  # granted once the holder let go
    assert holder.returncode == ExitCode.TAKEN_OVER
    assert one_line(said).startswith(f"lockrun: {name}: taken over by ")


_names = st.text(
    st.sampled_from("'\"\\/*$;-#` ")
    | st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]),
    min_size=1,
).filter(lambda text: len(text.encode()) <= 255)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=_names)
@example(payload=SQL_ISH[0])
@example(payload="$$ /* '")
def test_names_and_command_lines_go_into_a_window_as_data(postgres_uri: str, payload: str) -> None:
    """A window's row keeps its run's name, host, user and command line as data, for status."""
    name = f"{uuid.uuid4().hex[:8]}{payload}"[:60]
    holder = Holder(payload, 4242, f"u{payload}", (payload, "--", payload))
    locks = open_backend(parse_uri(postgres_uri), ttl=5.0)
    try:
        lease = locks.acquire(Request("props-hold", name, 1, 5.0, holder), now())
        assert lease is not None
        lease.release(hold=60)
        [state] = locks.status("props-hold", name)
        [shown] = state.holders
        assert shown.until is not None
        assert (state.name, shown.host, shown.pid, shown.user, shown.argv) == (name, *holder[:4])
    finally:
        locks.close()
    assert query(postgres_uri, f"SELECT to_regclass('{MARK}') IS NULL") == [(True,)]
