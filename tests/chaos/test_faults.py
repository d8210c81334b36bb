"""Chaos on every server backend: lag, resets, stray signals, stalls and a DBA's cancels.

Each test holds a lock on a server of its own with a proxy in front (`rig`, a harness of
tests/support/harness.py), breaks something, and judges lockrun by what the oracle saw
(tests/support/oracle.py): when each command started and ended, as the kernel tells it, and
each command's fence. The margins measured are printed at the end of the run. Partitions,
restarts and pauses, which every backend shares with the fault suite, are in
tests/contract/test_faults.py.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from lockrun.backends.mysql import lock_key as mysql_lock_key
from tests.support.cli import holder_pids, one_line, wait_for, waiter_pids
from tests.support.cli import lockrun as run_lockrun
from tests.support.harness import KILL_AFTER, LEASE, SESSION_BACKENDS, SLACK, TTL
from tests.support.servers import MariaServer

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.harness import Rig
    from tests.support.oracle import Oracle


pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

HOUR: Final = 3600.0  # a lease whose checks (every 20 min) no test waits for


def deaf(command: list[str]) -> list[str]:
    """Return *command* run with TERM ignored, as a command that is slow to clean up is."""
    return ["bash", "-c", 'trap "" TERM; exec "$@"', "deaf", *command]


def queued(rig: Rig, name: str, contender: subprocess.Popen[str]) -> None:
    """Wait until *contender* is in the queue for *name*, as `lockrun status` shows it.

    A waiter that has not queued yet when the server goes away reports 69 at once
    (README); a loaded machine can take more than a second to start one.
    """
    wait_for(lambda: waiter_pids(rig.uri, name) == [contender.pid], 30, "the contender to queue")


def lost(process: subprocess.Popen[str], timeout: float) -> str:
    """Assert *process* exits 76 with one line; return the line."""
    _, err = process.communicate(timeout=timeout)
    assert process.returncode == 76, err
    return one_line(err)


def test_slow_server_never_resurrects_a_lost_lease(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any], record: Callable[..., None]
) -> None:
    """A 2 s lag on a 2 s lease: the holder gives up, and its late calls revive nothing.

    Every renewal now reaches the server after the lease it renews ended (Redis) or after
    the server ended the idle session (MySQL, PostgreSQL). The holder must stop its
    command before then, a contender gets in, and while the holder's delayed calls keep
    landing (and after), the contender is the only holder the server knows.
    """
    ttl, delay = 2.0, 2.0
    lease = ("--ttl", f"{ttl:g}", "--kill-after", "0.5")
    holder, first = oracle.hold(spawn, "holder", "--uri", rig.proxied, *lease, "-n", name)
    rig.proxy.delay(delay)
    lagged = time.monotonic()
    spawn("--uri", rig.uri, *lease, "-n", name, "-w", "forever", "--", *oracle.command("second"))
    line = lost(holder, ttl + SLACK)
    assert "lease could not be confirmed" in line
    ended = oracle.wait_ended(first, timeout=1)
    second = oracle.wait_started("second", timeout=ttl + delay + SLACK)
    # The holder's last calls, and its goodbye, are still on their way: watch them land.
    seen: set[int] = set()
    watch_until = time.monotonic() + 2 * delay + 0.5
    while time.monotonic() < watch_until:
        seen.update(holder_pids(rig.uri, name))
        time.sleep(0.1)
    record("slow server", stopped_after=ended - lagged, margin=second.start - ended, delay=delay)
    assert holder.pid not in seen, "a late renewal brought the old lease back"
    assert seen <= {second.ppid}
    assert second.start > ended
    assert not oracle.overlaps()
    oracle.release(second)
    oracle.wait_ended(second)
    rig.proxy.delay(0)
    third = run_lockrun("--uri", rig.uri, "-n", name, "-w", "0", "--", "true")
    assert third.returncode == 0, third.stderr  # nothing left holds it


def test_reset_connections(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any], record: Callable[..., None]
) -> None:
    """An RST on every connection: a lease outlives it, a session lock does not.

    Redis keeps the lease on the server: the holder reconnects through the proxy, renews,
    and runs on undisturbed. A MySQL or PostgreSQL lock is its session, which the server
    ends at the RST; the holder must stop its command at once (not at its next check) and
    exit 76, and the contender that gets in has the larger fence.
    """
    # A session lock's lease is an hour (a check every 20 min): only the hang-up can stop it
    # within the test at all.
    lease = LEASE if rig.kind.leased else ("--ttl", f"{HOUR:g}", "--kill-after", f"{KILL_AFTER:g}")
    holder, first = oracle.hold(spawn, "holder", "--uri", rig.proxied, *lease, "-n", name)
    contender = spawn(
        "--uri", rig.uri, *lease, "-n", name, "-w", "forever", "--", *oracle.command("second")
    )
    queued(rig, name, contender)
    rig.proxy.reset()
    cut = time.monotonic()
    if not rig.kind.session:
        time.sleep(TTL + 0.5)  # several renewals, through a new connection
        assert first.end is None, "the holder stopped its command"
        assert not oracle.started("second")
        oracle.release(first)
        holder.communicate(timeout=10)
        assert holder.returncode == 0
        second = oracle.wait_started("second")
        record("reset", held_on="yes", fence_order=second.fence > first.fence)
    else:
        ended = oracle.wait_ended(first, timeout=60)  # hang guards, not budgets
        lost(holder, 30)
        second = oracle.wait_started("second", timeout=60)
        record("reset", stopped_after=ended - cut, margin=second.start - ended)
        # Told by the hang-up, not by its next check (in 20 min); the contender's start is a
        # race it wins by some milliseconds here (recorded), which no client can promise.
        assert ended - cut < HOUR / 3, "the holder noticed only at its next check"
    assert second.fence > first.fence
    oracle.release(second)


def test_a_stray_sigurg_is_not_a_hangup(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any]
) -> None:
    """SIGURG, which the hang-up watch uses, stops nothing when no session hung up."""
    holder, first = oracle.hold(spawn, "holder", "--uri", rig.uri, *LEASE, "-n", name)
    holder.send_signal(signal.SIGURG)
    time.sleep(0.3)
    assert first.end is None
    oracle.release(first)
    _, err = holder.communicate(timeout=10)
    assert holder.returncode == 0, err


def test_stall_between_grant_and_command_is_counted(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any], record: Callable[..., None]
) -> None:
    """A stall of 2.5 s of a 3 s lease after the grant, then the holder is cut off.

    strace delays the one pipe2(2) of a run, which the supervisor makes just before it
    spawns the command. The lease counts from the request that got it, so the stall is
    spent, not added: the command is stopped before the server lets the contender in.
    """
    stall = ["strace", "-f", "-qq", "-o", "/dev/null", "--seccomp-bpf"]
    stall += ["-e", "trace=pipe2", "-e", "inject=pipe2:delay_enter=2500000"]
    command = oracle.command("holder")
    holder = spawn("--uri", rig.proxied, *LEASE, "-n", name, "--", *command, under=stall)
    first = oracle.started_or_ended("holder", holder, 30)
    assert first is not None, holder.communicate(timeout=10)
    rig.proxy.blackhole()
    cut = time.monotonic()
    spawn("--uri", rig.uri, *LEASE, "-n", name, "-w", "forever", "--", *oracle.command("second"))
    ended = oracle.wait_ended(first, timeout=TTL + SLACK)
    second = oracle.wait_started("second", timeout=TTL + SLACK + 10)
    record("stall", stopped_after=ended - cut, margin=second.start - ended)
    lost(holder, KILL_AFTER + SLACK)
    assert not oracle.overlaps()
    oracle.release(second)


# -- a DBA cancels lockrun's statements (KILL QUERY, pg_cancel_backend) -------------------------


class Canceller(threading.Thread):
    """A DBA in a thread: cancel the statements of some sessions of a rig's server, again and again.

    *sessions* selects them: MySQL connection ids or PostgreSQL backend pids, asked for anew
    every round. MySQL's check is too quick to see in the process list, so it is cancelled
    blind, thousands of times a second; PostgreSQL's waits behind a lock on ``pg_locks`` that
    the canceller holds (`blocking`), and is cancelled while it waits.
    """

    def __init__(self, rig: Rig, sessions: Callable[[Any], list[int]], *, blocking: bool) -> None:
        """Connect as the server's superuser; `start` begins the cancelling."""
        super().__init__(name="canceller", daemon=True)
        self.kind = rig.backend
        self.sessions = sessions
        self.stopping = threading.Event()
        self.connection: Any
        if rig.backend == "mysql":
            import pymysql

            assert isinstance(rig.server, MariaServer)
            self.connection = pymysql.connect(unix_socket=rig.server.socket, user="root")
        else:
            import psycopg

            self.connection = psycopg.connect(
                host=rig.server.directory, port=rig.server.port, user="lockrun", dbname="lockrun"
            )
            if blocking:  # every look at pg_locks now waits for us: our chance to cancel it
                self.connection.execute("LOCK TABLE pg_catalog.pg_locks IN ACCESS EXCLUSIVE MODE")
            else:
                self.connection.commit()

    def run(self) -> None:
        """Cancel until stopped."""
        while not self.stopping.is_set():
            if self.kind == "mysql":
                with self.connection.cursor() as cursor:
                    ids = self.sessions(cursor)
                    for _ in range(200):
                        for session in ids:
                            with contextlib.suppress(Exception):  # it ended meanwhile
                                cursor.execute(f"KILL QUERY {session:d}")
            else:
                for pid in self.sessions(self.connection):
                    self.connection.execute("SELECT pg_cancel_backend(%s)", (pid,))
                time.sleep(0.002)

    def stop(self) -> None:
        """Stop cancelling, let go of what we hold, and hang up."""
        self.stopping.set()
        self.join(10)
        self.connection.close()


def holder_session(rig: Rig, name: str) -> Callable[[Any], list[int]]:
    """Return a query for the server session that holds *name*'s slot 0: KILL's target."""
    if rig.backend == "mysql":
        key = f"{mysql_lock_key('default', name)}:0"

        def mysql_holder(cursor: Any) -> list[int]:
            cursor.execute("SELECT IS_USED_LOCK(%s)", (key,))
            (session,) = cursor.fetchone()
            return [] if session is None else [int(session)]

        return mysql_holder

    def postgres_holder(connection: Any) -> list[int]:
        # Waiting for our lock on pg_locks (its check), in a transaction of our own.
        rows = connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock'",
            (f"lockrun:{name}:0",),
        ).fetchall()
        return [int(pid) for (pid,) in rows]

    return postgres_holder


def every_lockrun_session(rig: Rig) -> Callable[[Any], list[int]]:
    """Return a query for every client session but the canceller's own."""
    if rig.backend == "mysql":

        def mysql_sessions(cursor: Any) -> list[int]:
            cursor.execute(_MYSQL_CLIENTS)
            return [int(session) for (session,) in cursor.fetchall()]

        return mysql_sessions

    def postgres_sessions(connection: Any) -> list[int]:
        rows = connection.execute(_POSTGRES_ACTIVE).fetchall()
        return [int(pid) for (pid,) in rows]

    return postgres_sessions


_MYSQL_CLIENTS: Final = (
    "SELECT ID FROM information_schema.PROCESSLIST"
    " WHERE ID <> CONNECTION_ID() AND COMMAND <> 'Daemon' AND USER <> 'system user'"
)
_POSTGRES_ACTIVE: Final = (
    "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'"
    " AND pid <> pg_backend_pid() AND state = 'active'"
)
SQL: Final = pytest.mark.parametrize("rig", SESSION_BACKENDS, indirect=True)


@SQL
def test_a_cancelled_check_keeps_the_lock(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any], tmp_path: Path
) -> None:
    """A check cancelled once is asked again; the command runs on, and nobody else gets in.

    An earlier lockrun hung up its own session on any failed check, which freed the
    lock on the server while the command still ran its TERM grace.
    """
    log = tmp_path / "holder.log"
    with log.open("w") as stderr:
        options = ("--uri", rig.uri, "--ttl", "6", "--kill-after", "1", "-v", "-n", name)
        holder, first = oracle.hold(spawn, "holder", *options, stderr=stderr)
    canceller = Canceller(rig, holder_session(rig, name), blocking=True)
    canceller.start()
    try:
        wait_for(lambda: "cancelled" in log.read_text(), 60, "a check to be cancelled")
    finally:
        canceller.stop()
    contender = spawn("--uri", rig.uri, "-n", name, "-w", "forever", "--", *oracle.command("2"))
    queued(rig, name, contender)
    time.sleep(6 / 3 + 1)  # the retry, and the next check, go through
    assert first.end is None, log.read_text()
    assert not oracle.started("2")
    oracle.release(first)
    assert holder.wait(10) == 0, log.read_text()
    oracle.release(oracle.wait_started("2", timeout=10 + SLACK))
    assert not oracle.overlaps()


@pytest.mark.parametrize("rig", ["postgres"], indirect=True)  # MySQL's check cannot be held
def test_a_command_outlives_no_session_its_checks_were_cancelled_on(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any], record: Callable[..., None]
) -> None:
    """Every check cancelled: the deaf command is KILLed, and only then is the lock free.

    The contender queued on the same server must start after the command's end, however
    long its TERM grace (an earlier lockrun: an overlap of up to --kill-after).
    """
    options = ("--uri", rig.uri, "--ttl", f"{TTL:g}", "--kill-after", "10", "-n", name)
    holder, first = oracle.hold(spawn, "holder", *options, wrap=deaf)
    contender = spawn("--uri", rig.uri, "-n", name, "-w", "forever", "--", *oracle.command("2"))
    queued(rig, name, contender)
    canceller = Canceller(rig, holder_session(rig, name), blocking=True)
    canceller.start()
    began = time.monotonic()
    try:
        ended = oracle.wait_ended(first, timeout=TTL + SLACK)
        assert "cancelled" in lost(holder, SLACK)
    finally:
        canceller.stop()
    second = oracle.wait_started("2", timeout=10 + SLACK)
    record("cancelled checks", stopped_after=ended - began, margin=second.start - ended)
    assert not oracle.overlaps()
    oracle.release(second)


@SQL
def test_cancelling_every_statement_leaves_one_holder_and_clean_exits(
    rig: Rig, oracle: Oracle, name: str, spawn: Callable[..., Any]
) -> None:
    """A DBA cancels every statement of every session while lockruns come and go.

    Each lockrun exits 0, 69, 75 or 76 with one line, never 70; no two commands overlap;
    and once the DBA stops, the lock is free at once: nothing was left behind.
    """
    canceller = Canceller(rig, every_lockrun_session(rig), blocking=False)
    canceller.start()
    runs = []
    try:
        for round_ in range(6):
            for tag in range(3):
                command = oracle.command(f"{round_}-{tag}", hold=0.3)
                options = ("--uri", rig.uri, *LEASE, "-n", name, "-w", "2")
                runs.append(spawn(*options, "--", *command))
            for process in runs[-3:]:
                process.wait(30)
    finally:
        canceller.stop()
    for process in runs:
        _, err = process.communicate(timeout=10)
        assert process.returncode in {0, 69, 75, 76}, err
        assert "Traceback" not in err
        if process.returncode:
            one_line(err)
    assert not oracle.overlaps()
    after = run_lockrun("--uri", rig.uri, "-n", name, "--", "true")
    assert (after.returncode, after.stderr) == (0, "")
