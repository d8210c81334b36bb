"""What only PostgreSQL does for --shared, --hold-at-least and --take-over (docs/design.md A8).

The modes' contract is tests/contract/test_modes.py; here: the server's own lock queue
(mixed modes, first-in first-out), the keys, rows and channels an operator finds in
pg_locks, lockrun_holds and pg_stat_activity, the table's privileges, and the take-over's
bell. Every server is a real PostgreSQL: the session's, or a test's own.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from lockrun import ExitCode
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.postgres import WINDOWS, lock_key, slots_key
from lockrun.timing import now
from tests.support.cli import (
    RING_TTL,
    finish,
    lock_state,
    lockrun,
    one_line,
    queue_length,
    take_over_ring,
    wait_for,
)
from tests.support.net import postgres_query as query

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from subprocess import CompletedProcess, Popen

    from tests.support.cli import Held
    from tests.support.servers import PostgresServer

PASSWORD = "pw-for-modes"  # noqa: S105 - the throwaway server's
SLACK = 3.0  # a loaded 2-core machine: Python start-ups on the way
# A holder whose command ignores TERM: it is killed only after its --kill-after.
STUBBORN = "exec 2>/dev/null; trap '' TERM; echo up > {ready}; while :; do sleep 0.05; done"
COMMITS = "SELECT xact_commit FROM pg_stat_database WHERE datname = 'lockrun'"


def role_uri(server: PostgresServer, role: str) -> str:
    """Create *role* (password login, no superuser) on *server*; return its URI, no password."""
    server.command(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    return f"postgresql://{role}@/lockrun?host={server.directory}&port={server.port}"


def as_role() -> dict[str, str]:
    """Return an environment in which libpq finds the roles' password."""
    return {**os.environ, "PGPASSWORD": PASSWORD}


def advisory(uri: str, key: int) -> list[tuple[Any, ...]]:
    """Return (mode, granted, pid) of every advisory lock on the bigint *key*."""
    return sorted(
        query(
            uri,
            "SELECT mode, granted, pid FROM pg_locks WHERE locktype = 'advisory' "
            "AND objsubid = 1 AND (classid::bigint << 32 | objid::bigint) = %s",
            key,
        )
    )


def queued(uri: str, name: str, count: int) -> Callable[[], bool]:
    """Return a condition: *count* waiters are in *name*'s line."""
    return lambda: queue_length(uri, name) == count


def run(uri: str, name: str, *options: str, **kwargs: Any) -> CompletedProcess[str]:
    """Run ``lockrun --uri URI -n NAME OPTIONS -- true``."""
    return lockrun("--uri", uri, "-n", name, *options, "--", "true", **kwargs)


def stubborn(spawn: Callable[..., Popen[str]], uri: str, name: str, ready: Path) -> Popen[str]:
    """Start a holder whose command ignores TERM (killed after --kill-after 30 s)."""
    command = STUBBORN.format(ready=ready)
    holder = spawn("--uri", uri, "-n", name, "--kill-after", "30", "--", "sh", "-c", command)
    wait_for(ready.exists, what="the holder's command")
    return holder


# -- the server's lock queue ---------------------------------------------------------------------


def test_postgres_queues_shared_and_exclusive_requests_in_one_line(postgres_uri: str) -> None:
    """The property --shared relies on, on real sessions: no reader overtakes a queued writer.

    A reader holds; a writer queues; a later shared try fails and later shared waits
    queue behind the writer; the writer is granted first, then the readers together.
    """
    key = lock_key("fifo", f"proof-{time.monotonic_ns()}", 0)
    sessions = [psycopg.connect(postgres_uri, autocommit=True) for _ in range(4)]
    first, writer, second, third = sessions
    granted: list[str] = []

    def take(session: psycopg.Connection[Any], function: str, who: str) -> threading.Thread:
        def wait() -> None:
            session.execute(f"SELECT {function}(%s)", (key,))
            granted.append(who)

        thread = threading.Thread(target=wait)
        thread.start()
        return thread

    try:
        first.execute("SELECT pg_advisory_lock_shared(%s)", (key,))
        waits = [take(writer, "pg_advisory_lock", "writer")]
        wait_for(lambda: len(advisory(postgres_uri, key)) == 2, what="the writer to queue")
        tried = second.execute("SELECT pg_try_advisory_lock_shared(%s)", (key,)).fetchone()
        assert tried == (False,)
        waits += [take(second, "pg_advisory_lock_shared", "reader")]
        waits += [take(third, "pg_advisory_lock_shared", "reader")]
        wait_for(lambda: len(advisory(postgres_uri, key)) == 4, what="the readers to queue")
        assert granted == []
        first.execute("SELECT pg_advisory_unlock_shared(%s)", (key,))
        waits[0].join(10)
        assert granted == ["writer"]
        writer.execute("SELECT pg_advisory_unlock(%s)", (key,))
        for thread in waits[1:]:
            thread.join(10)
        assert granted == ["writer", "reader", "reader"]
        assert [row[:2] for row in advisory(postgres_uri, key)] == [("ShareLock", True)] * 2
    finally:
        for session in sessions:
            session.close()


# -- --shared ------------------------------------------------------------------------------------


def test_shared_holders_hold_sharelocks_and_no_fence(
    postgres_uri: str, held: Callable[..., Held], name: str
) -> None:
    """Readers hold slot 0's key as ShareLock, each the (name, 1) lock; no LOCKRUN_FENCE."""
    readers = [held("--uri", postgres_uri, "-n", name, "--shared") for _ in range(2)]
    assert [reader.fence for reader in readers] == [0, 0]  # Held's 0: the variable is unset
    locks = advisory(postgres_uri, lock_key("default", name, 0))
    assert [row[:2] for row in locks] == [("ShareLock", True)] * 2
    agreed = query(
        postgres_uri,
        "SELECT objid::bigint, mode FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND objsubid = 2 AND classid = (%s::bigint & 4294967295)::oid",
        slots_key("default", name),
    )
    assert agreed == [(1, "ShareLock")] * 2
    refused = run(postgres_uri, name, "-s", "2")
    assert refused.returncode == ExitCode.CONFIG
    assert "in use with 1 slot" in one_line(refused.stderr)
    assert run(postgres_uri, name).returncode == ExitCode.BUSY
    assert [reader.finish() for reader in readers] == [0, 0]
    writer = lockrun("--uri", postgres_uri, "-n", name, "--", "printenv", "LOCKRUN_FENCE")
    assert writer.returncode == 0
    assert int(writer.stdout) > 0


def test_status_tells_shared_waiters_and_holders_by_their_lock_mode(
    postgres_uri: str, held: Callable[..., Held], spawn: Callable[..., Popen[str]], name: str
) -> None:
    """A writer holds, a reader waits: the reader is a shared waiter; then a shared holder."""
    writer = held("--uri", postgres_uri, "-n", name)
    reader = spawn("--uri", postgres_uri, "-n", name, "--shared", "-w", "60", "--", "sleep", "30")
    wait_for(queued(postgres_uri, name, 1), what="the reader to queue")
    state = lock_state(postgres_uri, name)
    assert [holder["shared"] for holder in state["holders"]] == [False]
    assert [(waiter["pid"], waiter["shared"]) for waiter in state["waiters"]] == [
        (reader.pid, True)
    ]
    assert writer.finish() == 0
    wait_for(lambda: lock_state(postgres_uri, name)["holders"], what="the reader to hold")
    [holder] = lock_state(postgres_uri, name)["holders"]
    assert (holder["pid"], holder["shared"]) == (reader.pid, True)


# -- --hold-at-least -----------------------------------------------------------------------------


def test_a_window_is_a_row_on_the_servers_clock(postgres_uri: str, name: str) -> None:
    """lockrun_holds keeps (key, until, the run): until is the server's now + the hold."""
    [(before,)] = query(postgres_uri, "SELECT clock_timestamp()")
    assert run(postgres_uri, name, "--hold-at-least", "30").returncode == 0
    [(after,)] = query(postgres_uri, "SELECT clock_timestamp()")
    [(until, record)] = query(
        postgres_uri,
        f"SELECT until, holder FROM {WINDOWS} WHERE key = %s",  # noqa: S608 - our constant
        lock_key("default", name, 0),
    )
    assert before.timestamp() + 30 - SLACK < until.timestamp() <= after.timestamp() + 30
    identity = json.loads(record)
    assert (identity["namespace"], identity["name"], identity["slots"]) == ("default", name, 1)
    [holder] = lock_state(postgres_uri, name)["holders"]
    assert holder["until"] == pytest.approx(until.timestamp(), abs=0.01)
    assert (holder["argv"], holder["pid"]) == (["true"], identity["holder"]["pid"])
    assert advisory(postgres_uri, lock_key("default", name, 0)) == []  # no session holds it


def test_waiters_sit_out_a_window_in_arrival_order(
    postgres_uri: str, spawn: Callable[..., Popen[str]], name: str, tmp_path: Path
) -> None:
    """Waiters behind a window: the first holds slot 0 asleep (a waiter in status); in order."""
    log = tmp_path / "order"
    assert run(postgres_uri, name, "--hold-at-least", "4").returncode == 0
    waiters = []
    for count, who in enumerate(("one", "two"), start=1):
        command = ("sh", "-c", f"echo {who} >> {log}")
        waiters.append(spawn("--uri", postgres_uri, "-n", name, "-w", "30", "--", *command))
        wait_for(queued(postgres_uri, name, count), what=f"waiter {who} to queue")
    state = lock_state(postgres_uri, name)
    assert [holder["until"] is not None for holder in state["holders"]] == [True]
    assert [waiter["pid"] for waiter in state["waiters"]] == [waiter.pid for waiter in waiters]
    # Meanwhile the first holds the key, asleep on the server: it cannot lose its place.
    granted = [row[:2] for row in advisory(postgres_uri, lock_key("default", name, 0)) if row[1]]
    assert granted == [("ExclusiveLock", True)]
    assert [finish(waiter) for waiter in waiters] == [0, 0]
    assert log.read_text().split() == ["one", "two"]


def test_a_window_made_after_a_session_began_is_seen(pg_server: PostgresServer, name: str) -> None:
    """A kept session, set up before lockrun_holds existed, still finds a window made since.

    It asks pg_class under its statement's snapshot, then reads the table in a round trip
    of its own: the first window left on a server is respected as any.
    """
    backend = open_backend(parse_uri(pg_server.uri), ttl=5.0)
    request = Request("default", name, 1, 5.0, Holder.me(["test"]))
    try:
        lease = backend.acquire(request, now())
        assert lease is not None
        lease.release()  # its session is kept, knowing of no table
        assert pg_server.command(f"SELECT to_regclass('{WINDOWS}') IS NULL") == "t"
        assert run(pg_server.uri, name, "--hold-at-least", "30").returncode == 0
        assert backend.acquire(request, now()) is None
        assert backend.acquire(request, now() + 1) is None  # a wait shorter than the window
    finally:
        backend.close()


def test_a_role_that_cannot_create_the_table_is_refused_with_78(
    pg_server: PostgresServer, name: str
) -> None:
    """No CREATE on the schema (PostgreSQL 15's default for a role): 78 before the run, lock free.

    A window that could not be kept would let every host of a fleet run the job: said before
    anything runs, as the table is made when a hold first asks for the lock.
    """
    uri = role_uri(pg_server, "plain")
    argv = ("--uri", uri, "-n", name, "--hold-at-least", "30", "--", "echo", "ran")
    result = lockrun(*argv, env=as_role())
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, "")
    line = one_line(result.stderr)
    assert f"--hold-at-least needs table {WINDOWS}" in line
    assert "permission denied for schema public" in line
    again = run(uri, name, "-w", "0", env=as_role())
    assert (again.returncode, again.stderr) == (0, "")


def test_the_table_made_by_one_role_serves_every_role(pg_server: PostgresServer, name: str) -> None:
    """Made by one role and granted to PUBLIC: another role sees its windows and leaves its own."""
    uri = role_uri(pg_server, "other")
    assert run(pg_server.uri, name, "--hold-at-least", "30").returncode == 0
    busy = run(uri, name, env=as_role())
    assert busy.returncode == ExitCode.BUSY
    assert "--hold-at-least" in one_line(busy.stderr)
    theirs = f"{name}-theirs"
    left = run(uri, theirs, "--hold-at-least", "30", env=as_role())
    assert (left.returncode, left.stderr) == (0, "")
    assert run(pg_server.uri, theirs).returncode == ExitCode.BUSY


def test_ended_windows_are_deleted_by_the_next_one(pg_server: PostgresServer, name: str) -> None:
    """The table keeps about one row per open window: a hold deletes the rows that ended."""
    for index in range(3):
        assert run(pg_server.uri, f"{name}-{index}", "--hold-at-least", "0.2").returncode == 0
    time.sleep(0.5)
    assert run(pg_server.uri, name, "--hold-at-least", "30").returncode == 0
    assert pg_server.command(f"SELECT count(*) FROM {WINDOWS}") == "1"  # noqa: S608


# -- --take-over ---------------------------------------------------------------------------------


def test_a_taker_holds_the_stop_key_while_it_waits_and_lets_it_go_when_it_gives_up(
    postgres_uri: str, spawn: Callable[..., Popen[str]], name: str, tmp_path: Path
) -> None:
    """While it waits, the stop key is the taker's ShareLock; gone once it gave up (75)."""
    stop = lock_key("default", name, "stop")
    holder = stubborn(spawn, postgres_uri, name, tmp_path / "ready")
    taker = spawn("--uri", postgres_uri, "-n", name, "--take-over", "-w", "2", "--", "true")
    wait_for(lambda: advisory(postgres_uri, stop) != [], what="the taker's stop key")
    [(mode, granted, _)] = advisory(postgres_uri, stop)
    assert (mode, granted) == ("ShareLock", True)
    assert finish(taker) == ExitCode.BUSY  # the holder's command ignores TERM for 30 s
    assert advisory(postgres_uri, stop) == []
    assert holder.poll() is None  # still stopping


def test_a_granted_taker_holds_no_stop_key(
    postgres_uri: str, held: Callable[..., Held], spawn: Callable[..., Popen[str]], name: str
) -> None:
    """Once the taker runs, nobody holds the stop key: a later holder would be left alone."""
    holder = held("--uri", postgres_uri, "-n", name)
    taker = spawn("--uri", postgres_uri, "-n", name, "--take-over", "-w", "60", "--", "sleep", "2")
    wait_for(
        lambda: [one["pid"] for one in lock_state(postgres_uri, name)["holders"]] == [taker.pid],
        what="the taker to run",
    )
    # The grant's one statement takes the slot and then lets the stop key go: pg_locks may
    # show the first a moment before the second (seen once at load 20).
    wait_for(
        lambda: advisory(postgres_uri, lock_key("default", name, "stop")) == [],
        what="the granted taker to let the stop key go",
    )
    assert holder.process.wait(30) == ExitCode.TAKEN_OVER
    assert finish(taker) == 0


def test_a_bell_stops_a_holder_long_before_its_next_check(
    postgres_uri: str, name: str, tmp_path: Path
) -> None:
    """NOTIFY on the holder's session: it checks every 20 min, yet the taker's wait is met."""
    assert take_over_ring(postgres_uri, tmp_path, name) < RING_TTL / 3  # the bell, no check


def test_a_holder_checks_at_its_cadence_despite_its_bell(
    pg_server: PostgresServer, name: str
) -> None:
    """The bell is the session's socket, where each check's answer arrives too: no storm."""
    before = int(pg_server.command(COMMITS))
    result = lockrun("--uri", pg_server.uri, "-n", name, "--ttl", "3", "--", "sleep", "6")
    assert result.returncode == 0, result.stderr
    time.sleep(1.5)  # a session reports its counts as it ends
    # Six checks (one a second), set-up, grant, release and psql's own make 12: not dozens.
    assert int(pg_server.command(COMMITS)) - before < 20


def test_the_newest_taker_wins(
    postgres_uri: str, spawn: Callable[..., Popen[str]], name: str, tmp_path: Path
) -> None:
    """Two takers queue behind a holder: the first, granted while the second waits, gives way."""
    log = tmp_path / "ran"
    holder = stubborn(spawn, postgres_uri, name, tmp_path / "ready")
    takers: list[Popen[str]] = []
    for count, who in enumerate(("first", "second"), start=1):
        command = ("sh", "-c", f"echo {who} >> {log}")
        argv = ("--uri", postgres_uri, "-n", name, "--take-over", "-w", "90")
        takers.append(spawn(*argv, "--", *command))
        wait_for(queued(postgres_uri, name, count), what=f"the {who} taker to queue")
    os.kill(holder.pid, signal.SIGKILL)  # its guardian kills the command: the lock is free
    assert [finish(taker, 60) for taker in takers] == [ExitCode.TAKEN_OVER, 0]
    assert log.read_text().split() == ["second"]
