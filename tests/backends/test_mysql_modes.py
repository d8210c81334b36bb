"""What the fleet modes do on MySQL/MariaDB beyond the contract: costs, tables, takers, windows.

docs/design.md A7 gives the algorithm: a window is a row of lockrun_marks on the server's
clock, a shared holder a GET_LOCK and a row of its own, a take-over request the GET_LOCK
KEY:stop. The oracles are the commands' own logs, the server's locks and rows, and the
number of queries the driver sends.
"""

from __future__ import annotations

import json
import signal
from subprocess import PIPE
from typing import TYPE_CHECKING, Any

import pymysql
import pytest
from pymysql.constants import COMMAND

from lockrun import ExitCode
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.mysql import MARKS, TABLES, lock_key
from lockrun.timing import now
from tests.support.cli import (
    Held,
    finish,
    lockrun,
    one_line,
    queue_length,
    wait_for,
)
from tests.support.net import HOST, ME, create_user
from tests.support.net import mysql_query as query
from tests.support.servers import MariaServer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from subprocess import Popen

TTL = "5"  # a check every 5/3 s


def stamp(log: Path, what: str) -> str:
    """Return a shell snippet that appends "WHAT <Unix time>" to *log*."""
    return f"echo {what} $(date +%s.%N) >> {log}"


def read_log(log: Path) -> list[tuple[str, float]]:
    """Return the (what, when) lines `stamp` wrote, in order."""
    if not log.exists():
        return []
    return [(what, float(when)) for what, when in map(str.split, log.read_text().splitlines())]


@pytest.fixture(scope="module")
def old_server() -> Iterator[MariaServer]:
    """Return a MariaDB whose database ``old`` has only the tables of an earlier lockrun.

    ``old`` may read and write rows there, not create tables; ``nobody`` may only log in.
    """
    server = MariaServer()
    try:
        server.command("CREATE DATABASE old")
        for statement in TABLES:
            if MARKS not in statement:
                server.command(f"USE old; {statement}")
        create_user(server, "old", "pw-old", "SELECT, INSERT, UPDATE, DELETE ON old.*")
        create_user(server, "nobody", "pw-nobody")
    except BaseException:
        server.close()
        raise
    yield server
    server.close()


def as_user(server: MariaServer, user: str, database: str = "") -> str:
    """Return the lock URI of *server*'s socket for *user* (password pw-USER)."""
    return f"mysql://{user}:pw-{user}@localhost/{database}?unix_socket={server.socket}"


# -- what each mode costs -------------------------------------------------------------------


@pytest.fixture
def queries(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Return a list that gets every query PyMySQL sends from now on (one per round trip)."""
    sent: list[str] = []
    execute = pymysql.connections.Connection._execute_command  # type: ignore[attr-defined]

    def counted(connection: Any, command: int, sql: Any) -> Any:
        if command == COMMAND.COM_QUERY:
            sent.append(sql.decode() if isinstance(sql, bytes) else str(sql))
        return execute(connection, command, sql)

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", counted)
    return sent


@pytest.mark.parametrize(
    ("shared", "hold", "trips"),
    [(False, 0.0, 2), (True, 0.0, 2), (False, 0.2, 2)],
    ids=["exclusive", "shared", "hold"],
)
def test_an_uncontended_cycle_costs_its_round_trips(
    mysql_uri: str, name: str, queries: list[str], shared: bool, hold: float, trips: int
) -> None:
    """A kept session's cycle: two round trips, as raw GET_LOCK and RELEASE_LOCK (issue #32).

    Exclusive: the try with the grant (fence, record, checks, marks), the release.
    Shared: the entry (lock, row, checks), the release (row, lock). A hold: its row goes
    with the release.
    """
    backend = open_backend(parse_uri(mysql_uri), ttl=10.0)
    holder = Holder.me(["cycle"])._replace(shared=shared)
    try:
        for cycle in range(3):
            request = Request("default", f"{name}-{cycle}", 1, 10.0, holder, shared=shared)
            del queries[:]
            lease = backend.acquire(request, now())
            assert lease is not None
            assert (lease.fence is None) == shared
            lease.release(hold)
            if cycle:  # the first connects and may make the tables
                assert len(queries) == trips, queries
    finally:
        backend.close()


# -- tables: what works without lockrun_marks -----------------------------------------------


def test_hold_without_the_table_of_marks_is_78_before_anything_runs(
    old_server: MariaServer, name: str
) -> None:
    """A user who may not create lockrun_marks: 78 in one line before the run, lock free.

    The window could not be kept, which the user must hear of before the job runs on every
    host of the fleet; it must not hold the lock either.
    """
    uri = as_user(old_server, "old", "old")
    result = lockrun("--uri", uri, "-n", name, "--hold-at-least", "30", "--", "echo", "ran")
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
    line = one_line(result.stderr)
    assert "--hold-at-least needs lockrun's table lockrun_marks" in line
    assert "pw-old" not in line
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0
    assert old_server.command("SHOW TABLES FROM old").split() == [
        "lockrun_fence",
        "lockrun_holders",
    ]


@pytest.mark.parametrize(("user", "database"), [("old", "old"), ("nobody", "")])
def test_shared_without_the_table_of_marks_is_78_before_anything_runs(
    old_server: MariaServer, name: str, user: str, database: str
) -> None:
    """--shared needs lockrun_marks: 78, one line, the command never runs, nothing held."""
    uri = as_user(old_server, user, database)
    result = lockrun("--uri", uri, "-n", name, "--shared", "-w", "5", "--", "echo", "ran")
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
    assert "--shared needs lockrun's table lockrun_marks" in one_line(result.stderr)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


@pytest.mark.parametrize(("user", "database"), [("old", "old"), ("nobody", "")])
def test_take_over_works_without_the_table_of_marks(
    old_server: MariaServer, name: str, tmp_path: Path, user: str, database: str
) -> None:
    """The stop request is a lock: no table needed; the holder learns who from the processlist."""
    uri = as_user(old_server, user, database)
    holder = Held(tmp_path, "--uri", uri, "-n", name, "--ttl", TTL)
    taker = lockrun("--uri", uri, "-n", name, "--take-over", "-w", "30", "--", "echo", "ran")
    assert (taker.returncode, taker.stdout) == (0, "ran\n"), taker.stderr
    assert holder.process.wait(30) == ExitCode.TAKEN_OVER
    _, err = holder.process.communicate()
    line = one_line(err)
    assert line.startswith(f"lockrun: {name}: taken over by "), line
    assert f"{ME}@{HOST} pid " in line  # the taker's waiting statement names it


# -- take-over ------------------------------------------------------------------------------


def test_two_takers_the_newest_wins(
    mysql_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Popen[str]]
) -> None:
    """The older taker, granted while the newer one waits, gives way (79) without running."""
    log = tmp_path / "log"
    trapped = f"trap 'exit 0' TERM; {stamp(log, 'holder')}; while :; do sleep 0.05; done"
    # A check every 5 s: time for both takers to queue before the holder notices.
    holder = spawn("--uri", mysql_uri, "-n", name, "--ttl", "15", "--", "sh", "-c", trapped)
    wait_for(lambda: read_log(log), what="the holder's command")
    command = ("--uri", mysql_uri, "-n", name, "--take-over", "-w", "60", "--", "sh", "-c")
    older = spawn(*command, stamp(log, "older"))
    wait_for(lambda: queue_length(mysql_uri, name) == 1, what="the older taker")
    newer = spawn(*command, stamp(log, "newer"))
    wait_for(lambda: queue_length(mysql_uri, name) == 2, what="the newer taker")
    assert finish(newer) == 0
    _, err = older.communicate(timeout=30)
    assert older.returncode == ExitCode.TAKEN_OVER
    assert finish(holder) == ExitCode.TAKEN_OVER
    assert [what for what, _ in read_log(log)] == ["holder", "newer"]
    assert one_line(err).endswith(f"taken over by {ME}@{HOST} pid {newer.pid}")


def test_a_taker_ends_a_hold_window(mysql_uri: str, name: str) -> None:
    """--take-over does not wait for a window: there is no run left to stop."""
    window = ("--hold-at-least", "3600")
    assert lockrun("--uri", mysql_uri, "-n", name, *window, "--", "true").returncode == 0
    # A taker that waited for the hour's window would be busy (75) at the end of its wait.
    taker = lockrun("--uri", mysql_uri, "-n", name, "--take-over", "-w", "30", "--", "true")
    assert taker.returncode == 0, taker.stderr
    assert lockrun("--uri", mysql_uri, "-n", name, "--", "true").returncode == 0  # window gone


def test_a_waiter_sleeping_through_a_window_gives_way_to_a_taker(
    mysql_uri: str, name: str, spawn: Callable[..., Popen[str]]
) -> None:
    """A waiter holding slot 0 until a window ends looks every ttl/3: it sees the taker, 79."""
    hold = ("--hold-at-least", "60")
    assert lockrun("--uri", mysql_uri, "-n", name, *hold, "--", "true").returncode == 0
    options = ("--uri", mysql_uri, "-n", name, "--ttl", TTL, "-w", "120")
    waiter = spawn(*options, "--", "echo", "ran", stdout=PIPE)
    wait_for(lambda: queue_length(mysql_uri, name) == 1, what="the waiter to sleep")
    taker = lockrun("--uri", mysql_uri, "-n", name, "--take-over", "-w", "30", "--", "true")
    assert taker.returncode == 0, taker.stderr
    out, err = waiter.communicate(timeout=30)
    assert (waiter.returncode, out) == (ExitCode.TAKEN_OVER, "")
    assert "taken over by" in one_line(err)


# -- hold windows ---------------------------------------------------------------------------


def test_a_cancelled_sleep_through_a_window_sleeps_on(
    mysql_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Popen[str]]
) -> None:
    """KILL QUERY of a waiter's sleep on the server: it looks again and still waits the window."""
    log = tmp_path / "log"
    first = lockrun(
        *("--uri", mysql_uri, "-n", name, "--hold-at-least", "3"),
        *("--", "sh", "-c", stamp(log, "first")),
    )
    assert first.returncode == 0, first.stderr
    command = ("sh", "-c", stamp(log, "second"))
    waiter = spawn("--uri", mysql_uri, "-n", name, "--ttl", "30", "-w", "30", "--", *command)
    sleeping = (
        "SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE %s",
        (f"SELECT SLEEP(% AS '{lock_key('default', name)}:0'%",),
    )
    wait_for(lambda: query(mysql_uri, *sleeping), what="the waiter's sleep")
    [[session]] = query(mysql_uri, *sleeping)
    query(mysql_uri, "KILL QUERY %s", (session,))
    assert finish(waiter) == 0
    (_, began), (_, then) = read_log(log)
    assert then - began >= 3 - 0.05


def test_a_shared_try_during_a_window_is_busy_naming_it(mysql_uri: str, name: str) -> None:
    """A window keeps shared requests out too; the busy line names the run that holds it."""
    assert (
        lockrun("--uri", mysql_uri, "-n", name, "--hold-at-least", "60", "--", "true").returncode
        == 0
    )
    reader = lockrun("--uri", mysql_uri, "-n", name, "--shared", "--", "true")
    assert reader.returncode == ExitCode.BUSY
    assert "(--hold-at-least)" in one_line(reader.stderr)


# -- shared holders -------------------------------------------------------------------------


def test_rows_of_shared_holders_that_died_are_swept(
    mysql_uri: str, name: str, tmp_path: Path
) -> None:
    """A shared holder SIGKILLed leaves a row; the next exclusive grant deletes it."""
    key = lock_key("default", name)
    reader = Held(tmp_path, "--uri", mysql_uri, "-n", name, "--shared")
    count = (f"SELECT COUNT(*) FROM {MARKS} WHERE lock_key = %s AND mark LIKE 'r:%%'", (key,))  # noqa: S608 - our table's name
    assert query(mysql_uri, *count) == ((1,),)
    reader.process.send_signal(signal.SIGKILL)  # the guardian kills the command
    reader.process.communicate()
    assert query(mysql_uri, *count) == ((1,),)  # no goodbye: the row stays
    wait_for(
        lambda: lockrun("--uri", mysql_uri, "-n", name, "--", "true").returncode == 0,
        what="the reader's session to end",
    )
    assert query(mysql_uri, *count) == ((0,),)


def test_shared_holders_and_a_semaphore_disagree_on_n(
    mysql_uri: str, name: str, tmp_path: Path
) -> None:
    """A shared holder uses one slot: a user of 3 is refused (78), and the other way round."""
    reader = Held(tmp_path, "--uri", mysql_uri, "-n", name, "--shared")
    other = lockrun("--uri", mysql_uri, "-n", name, "--slots", "3", "-w", "5", "--", "true")
    assert other.returncode == ExitCode.CONFIG
    assert "in use with 1 slot" in one_line(other.stderr)
    assert reader.finish() == 0
    semaphore = Held(tmp_path, "--uri", mysql_uri, "-n", name, "--slots", "3")
    late = lockrun("--uri", mysql_uri, "-n", name, "--shared", "-w", "5", "--", "true")
    assert late.returncode == ExitCode.CONFIG
    assert "in use with 3 slots" in one_line(late.stderr)
    assert semaphore.finish() == 0


def test_status_names_a_writer_waiting_for_readers_as_a_waiter(
    mysql_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Popen[str]]
) -> None:
    """The writer holds slot 0 while it waits for the readers: status says it waits."""
    reader = Held(tmp_path, "--uri", mysql_uri, "-n", name, "--shared")
    writer = spawn("--uri", mysql_uri, "-n", name, "-w", "60", "--", "true")
    wait_for(lambda: queue_length(mysql_uri, name) == 1, what="the writer to wait")
    shown = lockrun("status", "--uri", mysql_uri, "--json", name)
    assert shown.returncode == 0, shown.stderr
    [state] = json.loads(shown.stdout)
    assert [h["pid"] for h in state["holders"]] == [reader.process.pid]
    assert state["holders"][0]["shared"] is True
    assert [w["pid"] for w in state["waiters"]] == [writer.pid]
    assert reader.finish() == 0
    assert finish(writer) == 0
