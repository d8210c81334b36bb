"""MariaDB faults while a lock is held or awaited: kills, pauses, restarts and partitions.

Each test runs lockrun against a real mariadbd and breaks something underneath it: KILL of
the holding session, SIGKILL or SIGSTOP of a holder or waiter, a server restart, a silent
network partition (tests/proxy.py), signals while waiting, `--slots` disagreements. Then it
checks SPEC §4.1–§4.6 with independent evidence: files the commands write (with Unix-time
stamps), /proc, pidfds, and the server's own view (IS_USED_LOCK, information_schema's
PROCESSLIST, the fence table, a GET_LOCK of our own). Leases are short (2–3 s,
`--kill-after 1`) so the file runs in about a minute.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pymysql
import pytest

from lockrun.backends import parse_uri
from lockrun.backends.mysql import lock_key, parse
from tests.support.cli import (
    Held,
    finish,
    gone,
    interval_log,
    lockrun,
    one_line,
    wait_for,
)
from tests.support.proxy import Proxy
from tests.test_redis_faults import Victim, check_lost

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.servers import MariaServer

TTL: Final = 3.0  # seconds: ownership checks every second, wait_timeout 3
KILL_AFTER: Final = 1.0
# Where the lease length does not matter: every call may then take 0.5 s (ttl/20), which a
# machine busy with other test runs can need.
CALM: Final = ("--ttl", "10")
SLACK: Final = 3.0  # generous: a shared 2-core machine, and Python start-ups on the way
LEASE: Final = ("--ttl", f"{TTL:g}", "--kill-after", f"{KILL_AFTER:g}")
# The server frees an idle session's locks after wait_timeout = ceil(ttl); lockrun must not
# let anyone in much earlier than that (a tenth: timer and clock granularity).
EARLY: Final = 0.9


def connect(uri: str) -> pymysql.Connection[Any]:
    """Open a session of our own (not lockrun's) on the server of *uri*."""
    settings = parse(parse_uri(uri))
    return pymysql.connect(**settings.kwargs, autocommit=True, connect_timeout=5, read_timeout=60)


def query(uri: str, sql: str, args: object = None) -> tuple[tuple[Any, ...], ...]:
    """Run *sql* on a fresh session of our own and return every row."""
    with contextlib.closing(connect(uri)) as connection, connection.cursor() as cursor:
        cursor.execute(sql, args)
        return tuple(cursor.fetchall())


def owner(uri: str, lock: str) -> int | None:
    """Return the connection id that holds the user lock *lock*, or None if it is free."""
    ((holder,),) = query(uri, "SELECT IS_USED_LOCK(%s)", (lock,))
    return None if holder is None else int(holder)


# Every client session on the server but ours: id, command, seconds in it, statement.
SESSIONS: Final = (
    "SELECT ID, COMMAND, TIME_MS / 1000, INFO, UNIX_TIMESTAMP(NOW(6)) "
    "FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND DB = DATABASE() "
    "AND COMMAND NOT IN ('Daemon', 'Killed') AND USER <> 'system user'"
)


class Session(NamedTuple):
    """One row of the server's processlist."""

    id: int
    command: str
    seconds: float  # in its current command (Sleep: since its last statement ended)
    info: str  # the statement it runs, or ""
    now: float  # the server's clock (Unix time) when it was read


def sessions(uri: str) -> list[Session]:
    """Return every client session of the server (but ours) in lockrun's database."""
    return [
        Session(int(row[0]), str(row[1]), float(row[2]), str(row[3] or ""), float(row[4]))
        for row in query(uri, SESSIONS)
    ]


def session(uri: str, connection: int) -> Session | None:
    """Return the processlist row of *connection*, None if it is gone."""
    found = [each for each in sessions(uri) if each.id == connection]
    return found[0] if found else None


# A waiter's GET_LOCK carries a comment naming it; the first "pid" is the waiting lockrun's.
WAITING: Final = re.compile(r"GET_LOCK\('(?P<lock>[^']+)'.*?\"pid\": (?P<pid>\d+)[,}]", re.DOTALL)


def waits_of(uri: str, pid: int) -> dict[int, str]:
    """Return the sessions of lockrun *pid* that wait in GET_LOCK, and the lock each waits on."""
    found = {}
    for each in sessions(uri):
        match = WAITING.search(each.info)
        if match is not None and int(match["pid"]) == pid:
            found[each.id] = match["lock"]
    return found


def session_ids(uri: str) -> set[int]:
    """Return the ids of every client session of the server (but ours) in lockrun's database."""
    return {each.id for each in sessions(uri)}


def slot_locks(key: str, slots: int) -> list[str]:
    """Return the GET_LOCK names of *slots* slots of *key*."""
    return [f"{key}:{slot}" for slot in range(slots)]


# -- commands and their evidence -----------------------------------------------------------------


# A command that logs its pid, fence and start (Unix ns) in its log, then a heartbeat every
# 2 ms until its go file exists, and a last stamp. With a third argument, another command's
# log: it also notes whether that command was still alive when this one started.
COMMAND: Final = """
import os, sys, time
log, go = sys.argv[1], sys.argv[2]
started = time.time_ns()
verdict = "-"
if len(sys.argv) > 3:
    try:
        pid = int(open(sys.argv[3]).read().split()[0])
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the other never started, or has gone
        state = "gone"
    verdict = "overlap" if state not in {"Z", "X", "gone"} else "alone"
with open(log + ".tmp", "w") as head:
    head.write(f"{os.getpid()} {os.environ['LOCKRUN_FENCE']} {started} {verdict}\\n")
os.rename(log + ".tmp", log)
with open(log, "a", buffering=1) as out:
    while not os.path.exists(go):
        out.write(f"{time.time_ns()}\\n")
        time.sleep(0.002)
    out.write(f"{time.time_ns()}\\n")
"""


class Run(NamedTuple):
    """What a `COMMAND` wrote: its pid, fence, start, verdict and its last sign of life."""

    pid: int
    fence: int
    start: float  # Unix time
    verdict: str  # "alone", "overlap" or "-"
    last: float  # Unix time of its last heartbeat


def read_run(log: Path) -> Run:
    """Parse a `COMMAND`'s log (a SIGKILL may have cut it short after any whole line)."""
    head, *beats = log.read_text().splitlines()
    pid, fence, started, verdict = head.split()
    stamps = [int(beat) for beat in beats if beat.isdigit()]
    last = max(stamps, default=int(started))
    return Run(int(pid), int(fence), int(started) / 1e9, verdict, last / 1e9)


def command(
    tmp_path: Path, label: str, *, other: Path | None = None
) -> tuple[list[str], Path, Path]:
    """Return the argv of a `COMMAND` labelled *label*, its log and its go file."""
    script = tmp_path / "command.py"
    if not script.exists():
        script.write_text(COMMAND)
    log, go = tmp_path / f"{label}.log", tmp_path / f"{label}.go"
    argv = [sys.executable, str(script), str(log), str(go)]
    if other is not None:
        argv.append(str(other))
    return argv, log, go


def wait_for_death(pidfd: int, deadline: float) -> float | None:
    """Sleep until the process of *pidfd* exits; return the Unix time we woke to see it.

    None means it still ran at *deadline* (Unix time). An exit wakes us at once, so the
    time returned is late only by our own scheduling delay.
    """
    while True:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.time()))
        if ready:
            return time.time()
        if time.time() >= deadline:
            return None


def stopped(pid: int) -> bool:
    """Return whether *pid* is stopped (SIGSTOP took effect)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"


# -- 1, 5: the session or the server goes away under a holder -----------------------------------


def lose_the_session(
    uri: str,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[str]],
    cut: Callable[[int], object],
) -> Victim:
    """Hold *name* on *uri*, end the holding session with *cut*, and check SPEC §4.3's stop.

    *cut* gets the holding connection's id. The next ownership check (≤ ttl/3) fails: TERM
    at once, KILL after --kill-after, exit 76 with one line, so lockrun is done within
    ttl/3 + --kill-after of the cut (plus slack). Times come from a pidfd and the TERM trap.
    """
    victim = Victim(tmp_path)
    process = victim.start(spawn, "--uri", uri, *LEASE, "-n", name)
    connection = owner(uri, f"{lock_key('default', name)}:0")
    assert connection is not None
    pidfd = os.pidfd_open(process.pid)
    try:
        cut_at = time.time()
        cutting = threading.Thread(target=cut, args=(connection,))
        cutting.start()
        ended = wait_for_death(pidfd, cut_at + TTL / 3 + KILL_AFTER + SLACK + 10)
        cutting.join(60)
    finally:
        os.close(pidfd)
    assert ended is not None, "lockrun did not exit"
    _, err = process.communicate(timeout=10)
    assert victim.term_file.exists(), "the command was not sent TERM"
    assert gone(victim.pid)
    term, elapsed = victim.term_time() - cut_at, ended - cut_at
    print(f"session ended → TERM after {term:.2f}s, lockrun exited after {elapsed:.2f}s")
    assert term < TTL / 3 + SLACK
    assert elapsed < TTL / 3 + KILL_AFTER + SLACK
    line = check_lost(process.returncode, err, name)
    assert "the session holding the lock ended" in line
    return victim


@pytest.mark.timeout(30)
def test_killed_session_stops_the_command_and_exits_76(
    mysql_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """KILL CONNECTION of the holding session: TERM the command, exit 76 within ttl/3 + grace."""

    def kill(connection: int) -> None:
        query(mysql_uri, f"KILL CONNECTION {connection:d}")

    lose_the_session(mysql_uri, name, tmp_path, spawn, kill)
    assert owner(mysql_uri, f"{lock_key('default', name)}:0") is None


@pytest.mark.timeout(60)
def test_server_restart_stops_the_holder_and_the_next_fence_is_larger(
    maria_server: MariaServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A restart mid-hold (TCP) stops the command (76); the fence survives, the next is larger.

    The holder on the unix socket meets a restart in the last test of this file.
    """
    uri = maria_server.tcp_uri
    first = lose_the_session(uri, name, tmp_path, spawn, lambda _: maria_server.restart())
    key = lock_key("default", name)
    # InnoDB kept the last fence through kill -9; the next holder draws a larger one.
    assert query(uri, "SELECT fence FROM lockrun_fence WHERE lock_key = %s", (key,)) == (
        (first.fence,),
    )
    second = lockrun("--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert second.returncode == 0, second.stderr
    assert int(second.stdout) > first.fence


# -- 2, 3, 4: processes that die or freeze without a word ----------------------------------------


@pytest.mark.timeout(40)
def test_sigkilled_holder_takes_its_command_along_and_the_waiter_gets_in_at_once(
    mysql_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """SIGKILL of a holder: the guardian kills its command, then the waiter gets in at once.

    With --ttl 10 a start within 1.5 s is the closed session, not a lease running out; the
    waiter's command starts after the first one's last heartbeat and finds it dead.
    """
    options = ("--uri", mysql_uri, "-n", name, *CALM)
    first_argv, first_log, first_go = command(tmp_path, "first")
    # stderr not piped: a surviving command would hold the pipe open.
    holder = spawn(*options, "--", *first_argv, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: first_log.exists() or holder.poll() is not None, what="the first command")
        first_pid = read_run(first_log).pid
        second_argv, second_log, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        waiter = spawn(*options, "-w", "forever", "--", *second_argv)
        wait_for(lambda: waits_of(mysql_uri, waiter.pid), what="the waiter to queue")
        killed_at = time.time()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        wait_for(lambda: gone(first_pid), timeout=5, what="the guardian to kill the command")
        assert finish(waiter, timeout=20) == 0
    finally:
        first_go.touch()  # whatever failed, no loop is left running
    first, second = read_run(first_log), read_run(second_log)
    waited = second.start - killed_at
    print(
        f"waiter's command started {waited:.3f}s after the SIGKILL, "
        f"{second.start - first.last:.3f}s after the first command's last heartbeat"
    )
    assert waited < 1.5
    assert second.verdict == "alone"
    assert second.start > first.last  # [start, last] intervals do not overlap
    assert second.fence > first.fence


@pytest.mark.timeout(40)
def test_paused_holder_loses_the_lock_after_a_ttl_and_stops_its_command_on_resume(
    mysql_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """SIGSTOP of a holder: the server frees the lock a ttl after its last check; 76 on SIGCONT.

    The waiter gets in no earlier than 0.9 ttl after the holder's last statement (read from
    the processlist) and not much later than a ttl; the resumed holder TERMs its command and
    exits 76; the newer holder's fence is larger.
    """
    key = lock_key("default", name)
    victim = Victim(tmp_path)
    process = victim.start(spawn, "--uri", mysql_uri, *LEASE, "-n", name)
    holding = owner(mysql_uri, f"{key}:0")
    assert holding is not None
    argv, log, go = command(tmp_path, "later")
    go.touch()
    waiter = spawn("--uri", mysql_uri, *LEASE, "-n", name, "-w", "forever", "--", *argv)
    wait_for(lambda: waits_of(mysql_uri, waiter.pid), what="the waiter to queue")
    process.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(process.pid), what="lockrun to stop")
        # A check sent just before the stop may still be running: read the idle session.
        wait_for(
            lambda: (row := session(mysql_uri, holding)) is not None and row.command == "Sleep",
            what="the holder's session to idle",
        )
        idle = session(mysql_uri, holding)
        assert idle is not None
        last = idle.now - idle.seconds  # when the holder's last statement ended
        assert finish(waiter, timeout=TTL + SLACK + 10) == 0
        later = read_run(log)
        assert session(mysql_uri, holding) is None  # the server ended the idle session
    finally:
        process.send_signal(signal.SIGCONT)
    waited = later.start - last
    print(f"paused holder: the waiter's command started {waited:.2f}s after its last check")
    assert EARLY * TTL <= waited < TTL + SLACK
    assert later.fence > victim.fence
    status = process.wait(timeout=TTL / 3 + KILL_AFTER + SLACK)
    _, err = process.communicate(timeout=10)
    assert victim.term_file.exists(), "the command was not sent TERM"
    assert gone(victim.pid)
    check_lost(status, err, name)


@pytest.mark.timeout(40)
def test_paused_head_waiter_is_passed_over_and_never_runs_without_the_lock(
    mysql_uri: str,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A frozen head waiter granted the lock loses it after its wait_timeout; never runs meanwhile.

    The second waiter gets in about a ttl after the grant (the frozen session's
    wait_timeout). Resumed while the second runs, the first must not run its command until
    the second's ended: it exits 69 without running, or queues again and runs after it.
    """
    key = lock_key("default", name)
    holder = held("--uri", mysql_uri, *LEASE, "-n", name)
    next_argv, next_log, next_go = command(tmp_path, "next")
    head_argv, head_log, head_go = command(tmp_path, "head", other=next_log)
    head_go.touch()
    options = ("--uri", mysql_uri, *LEASE, "-n", name, "-w", "forever", "--")
    head = spawn(*options, *head_argv)
    wait_for(lambda: waits_of(mysql_uri, head.pid), what="the head waiter")
    (head_session,) = waits_of(mysql_uri, head.pid)
    second = spawn(*options, *next_argv)
    wait_for(lambda: waits_of(mysql_uri, second.pid), what="the second waiter")
    head.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(head.pid), what="the head waiter to stop")
        assert holder.finish() == 0
        # The server hands the lock to the frozen head's session, which cannot answer.
        wait_for(lambda: owner(mysql_uri, f"{key}:0") == head_session, what="the grant")
        granted = time.time()
        wait_for(next_log.exists, timeout=TTL + SLACK, what="the second waiter's command")
        passed = read_run(next_log).start - granted
        print(f"the second waiter got in {passed:.2f}s after the frozen head was granted")
        assert EARLY * TTL - 0.3 <= passed < TTL + SLACK  # -0.3: we saw the grant late
    finally:
        head.send_signal(signal.SIGCONT)
    try:  # the second still runs: the head must wait, or give up
        wait_for(
            lambda: head.poll() is not None or waits_of(mysql_uri, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        assert not head_log.exists(), "the resumed waiter runs its command beside the holder"
    finally:
        next_go.touch()
    assert finish(second) == 0
    _, err = head.communicate(timeout=SLACK + 10)
    print(f"the resumed head waiter exited {head.returncode}: {err.strip()}")
    if head.returncode == 0:  # it queued again and ran after the second
        first_run, second_run = read_run(head_log), read_run(next_log)
        assert first_run.verdict == "alone"
        assert first_run.start > second_run.last
        assert first_run.fence > second_run.fence
    else:
        assert head.returncode == 69, err
        assert name in one_line(err)
        assert not head_log.exists()


@pytest.mark.timeout(40)
def test_paused_head_of_a_semaphore_queue_lets_the_next_waiter_through(
    mysql_uri: str,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A frozen N = 2 head waiter frees the gate within ttl/3 + ttl; the next waiter gets in.

    The head asks for the slots in pieces of ttl/3, so once frozen its sessions idle and
    their wait_timeout ends them. The waiter behind it takes the gate, waits on the slots
    and gets the first one freed; the resumed head runs only once a slot is free for it.
    """
    key = lock_key("default", name)
    options = ("--uri", mysql_uri, *LEASE, "-n", name, "-s", "2", "-w", "forever")
    holders = sorted((held(*options) for _ in range(2)), key=lambda holder: holder.slot)
    head_argv, head_log, head_go = command(tmp_path, "head")
    next_argv, next_log, next_go = command(tmp_path, "next")
    head_go.touch()
    head = spawn(*options, "--", *head_argv)
    wait_for(lambda: len(waits_of(mysql_uri, head.pid)) == 2, what="the head's waits")
    gate = owner(mysql_uri, f"{key}:gate")
    assert gate in waits_of(mysql_uri, head.pid)
    second = spawn(*options, "--", *next_argv)
    wait_for(
        lambda: list(waits_of(mysql_uri, second.pid).values()) == [f"{key}:gate"],
        what="the second waiter at the gate",
    )
    head.send_signal(signal.SIGSTOP)
    try:
        stopped_at = time.time()
        wait_for(lambda: stopped(head.pid), what="the head waiter to stop")
        wait_for(
            lambda: owner(mysql_uri, f"{key}:gate") != gate,
            timeout=TTL / 3 + TTL + SLACK,
            what="the server to end the frozen head's gate session",
        )
        took = time.time() - stopped_at
        print(f"the frozen head's gate session ended {took:.2f}s after it froze")
        assert took >= EARLY * TTL
        wait_for(
            lambda: sorted(waits_of(mysql_uri, second.pid).values()) == slot_locks(key, 2),
            timeout=SLACK,
            what="the second waiter to become the head",
        )
        assert holders[0].finish() == 0
        wait_for(next_log.exists, timeout=SLACK, what="the second waiter's command")
    finally:
        head.send_signal(signal.SIGCONT)
    try:  # two commands run: the head must wait, or give up
        wait_for(
            lambda: head.poll() is not None or waits_of(mysql_uri, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        assert not head_log.exists(), "a third command runs beside two holders of 2 slots"
    finally:
        next_go.touch()
    assert finish(second) == 0
    _, err = head.communicate(timeout=SLACK + 10)
    print(f"the resumed head waiter exited {head.returncode}: {err.strip()}")
    if head.returncode == 0:  # it queued again and ran after the second
        first_run, second_run = read_run(head_log), read_run(next_log)
        assert first_run.start > second_run.last
        assert first_run.fence > second_run.fence
    else:
        assert head.returncode == 69, err
        assert name in one_line(err)
        assert not head_log.exists()
    assert holders[1].finish() == 0


@pytest.mark.timeout(30)
def test_briefly_paused_semaphore_head_waits_on(
    mysql_uri: str,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """An N = 2 head waiter (-w forever) paused for less than its lease keeps waiting, then runs."""
    key = lock_key("default", name)
    options = ("--uri", mysql_uri, *LEASE, "-n", name, "-s", "2", "-w", "forever")
    holders = [held(*options) for _ in range(2)]
    argv, log, go = command(tmp_path, "head")
    go.touch()
    head = spawn(*options, "--", *argv)
    wait_for(lambda: len(waits_of(mysql_uri, head.pid)) == 2, what="the head's waits")
    head.send_signal(signal.SIGSTOP)
    try:
        # Longer than a ttl/3 piece of GET_LOCK, shorter than the sessions' wait_timeout.
        time.sleep(TTL / 2)
        assert owner(mysql_uri, f"{key}:gate") is not None  # its sessions live on
    finally:
        head.send_signal(signal.SIGCONT)
    try:
        wait_for(
            lambda: (
                head.poll() is not None
                or sorted(waits_of(mysql_uri, head.pid).values()) == slot_locks(key, 2)
            ),
            timeout=SLACK,
            what="the resumed head to wait again",
        )
        assert head.poll() is None, head.communicate()[1]
    finally:
        assert [holder.finish() for holder in holders] == [0, 0]
    _, err = head.communicate(timeout=SLACK + 10)
    assert head.returncode == 0, err
    assert log.exists()


# -- 6: a partition ------------------------------------------------------------------------------


def direct_get_lock(uri: str, lock: str, patience: float, got: list[float]) -> None:
    """Wait for *lock* on a session of our own; append the Unix time it was ours."""
    with contextlib.closing(connect(uri)) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, %s)", (lock, patience))
        ((result,),) = cursor.fetchall()
        if result == 1:
            got.append(time.time())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ttl", "kill_after", "exit_on_term"),
    [
        # The last good check at C; the next (C+1) hangs; TERM ~C+2; the server frees at C+3.
        pytest.param(TTL, KILL_AFTER, True, id="exits-on-TERM"),
        # The check at C+2 hangs, doubted at C+3: TERM at C+3.7, KILL at C+5.4; free at C+6.
        pytest.param(6.0, 1.7, False, id="ignores-TERM"),
        # The check at C+0.67 times out at C+1.33 (ttl/3): TERM, then KILL at C+2.33, after
        # the server freed the lock at C+2 (wait_timeout 2).
        pytest.param(
            2.0,
            KILL_AFTER,
            False,
            id="ignores-TERM-short-ttl",
        ),
    ],
)
def test_partition_kills_the_command_before_the_server_frees_the_lock(
    maria_server: MariaServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    ttl: float,
    kill_after: float,
    exit_on_term: bool,
) -> None:
    """A silent partition: the command is dead before the server frees the lock; exit 76.

    The server frees the slot wait_timeout = ceil(ttl) after the last statement it got; a
    client on the server's side of the partition waits on the slot with GET_LOCK and must
    get it only after the command died.
    """
    key = lock_key("default", name)
    lease = ("--ttl", f"{ttl:g}", "--kill-after", f"{kill_after:g}")
    with contextlib.closing(Proxy(("127.0.0.1", maria_server.port))) as proxy:
        through = f"mysql://root@127.0.0.1:{proxy.port}/lockrun"
        victim = Victim(tmp_path, exit_on_term=exit_on_term)
        process = victim.start(spawn, "--uri", through, *lease, "-n", name)
        holding = owner(maria_server.uri, f"{key}:0")
        assert holding is not None
        pidfd = os.pidfd_open(victim.pid)  # readable once the command has exited
        try:
            # Cut soon after a check went through, so the next one is the first to hang (a
            # loaded machine may look too late after several; `last` is read afterwards).
            wait_for(
                lambda: (
                    (row := session(maria_server.uri, holding)) is not None and row.seconds < 0.25
                ),
                timeout=ttl + SLACK,
                what="an ownership check through the proxy",
            )
            proxy.blackhole()
            time.sleep(0.1)  # a check the proxy was already forwarding has landed by now
            idle = session(maria_server.uri, holding)
            assert idle is not None
            last = idle.now - idle.seconds  # the server frees the slot ceil(ttl) after this
            got: list[float] = []
            direct = threading.Thread(
                target=direct_get_lock,
                args=(maria_server.uri, f"{key}:0", ttl + SLACK + 10, got),
            )
            direct.start()
            ended = wait_for_death(pidfd, last + ttl + SLACK)
            direct.join(ttl + SLACK + 10)
        finally:
            os.close(pidfd)
        status = process.wait(timeout=kill_after + SLACK)
        _, err = process.communicate(timeout=10)
    assert ended is not None, "the command was never stopped"
    assert got, "the direct client never got the lock"
    margin = got[0] - ended  # a lower bound: we saw the death a little after it came
    freed = got[0] - last
    term = victim.term_time() - last if victim.term_file.exists() else float("nan")
    report = (
        f"partition, ttl {ttl:g}, kill-after {kill_after:g}, command "
        f"{'exits on' if exit_on_term else 'ignores'} TERM: after the last check that got "
        f"through: TERM at +{term:.2f}s, death seen at +{ended - last:.2f}s, lock freed at "
        f"+{freed:.2f}s; margin {margin:.3f}s; lockrun exited {status}"
    )
    print(report)
    assert freed >= EARLY * ttl, report  # the server kept the slot for its wait_timeout
    assert margin > 0, report  # SPEC §4.2: never both "lock free" and "command running"
    check_lost(status, err, name)


# -- 7, 8: waiters that give up or get in leave nothing behind -----------------------------------


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    ("signo", "slots"),
    [
        pytest.param(signal.SIGINT, 1, id="INT-mutex"),
        pytest.param(signal.SIGTERM, 3, id="TERM-semaphore-head"),
    ],
)
def test_interrupted_waiter_leaves_no_session_and_no_gate(
    mysql_uri: str,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., Any],
    slots: int,
    signo: signal.Signals,
) -> None:
    """INT/TERM while waiting: 130/143 with one line; its sessions and waits leave the server.

    With N = 3 the head waiter holds the gate and waits on every slot with 3 sessions; all
    of them go within about a second (the server looks at a waiting client once a second),
    the gate is free, and once the holders finish nothing is held at all.
    """
    key = lock_key("default", name)
    options = ("--uri", mysql_uri, *CALM, "-n", name, "-s", str(slots))
    holders = [held(*options) for _ in range(slots)]
    before = session_ids(mysql_uri)
    waiter = spawn(*options, "-w", "forever", "--", "true")
    wait_for(lambda: len(waits_of(mysql_uri, waiter.pid)) == slots, what="the waiter's waits")
    waits = waits_of(mysql_uri, waiter.pid)
    assert sorted(waits.values()) == slot_locks(key, slots)
    if slots > 1:
        assert owner(mysql_uri, f"{key}:gate") in waits  # the head holds the gate
    assert session_ids(mysql_uri) - before == waits.keys()  # every session of it waits
    signalled = time.monotonic()
    waiter.send_signal(signo)
    _, err = waiter.communicate(timeout=10)
    assert waiter.returncode == 128 + signo, err
    line = one_line(err)
    assert name in line
    assert "nothing is held" in line
    wait_for(
        lambda: (
            not waits_of(mysql_uri, waiter.pid)
            and not session_ids(mysql_uri) - before
            and owner(mysql_uri, f"{key}:gate") is None
        ),
        timeout=1 + SLACK,
        what="the waiter's sessions to end",
    )
    print(f"the waiter's sessions were gone {time.monotonic() - signalled:.2f}s after {signo!r}")
    assert [holder.finish() for holder in holders] == [0] * slots
    assert [owner(mysql_uri, lock) for lock in [*slot_locks(key, slots), f"{key}:gate"]] == [
        None
    ] * (slots + 1)
    after = lockrun(*options, "--", "true")
    assert after.returncode == 0, after.stderr


# A command that publishes its slot in a ready file and runs until its go file exists.
HOLD: Final = (
    "echo $LOCKRUN_SLOT > {ready}.tmp; mv {ready}.tmp {ready}; "
    "while [ ! -e {go} ]; do sleep 0.01; done"
)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("freed", [0, 2])
def test_granted_head_keeps_one_session_and_one_slot(
    mysql_uri: str,
    name: str,
    held: Callable[..., Held],
    tmp_path: Path,
    spawn: Callable[..., Any],
    freed: int,
) -> None:
    """An N = 3 head waiter granted a slot: its helper sessions end, it holds that slot only.

    Slot 0 comes free on the head's first session; slot 2 on a helper (the first one, which
    held the gate, is then killed). Either way the gate is free and the other slots stay
    with their holders' sessions.
    """
    key = lock_key("default", name)
    options = ("--uri", mysql_uri, *CALM, "-n", name, "-s", "3")
    holders = sorted((held(*options) for _ in range(3)), key=lambda holder: holder.slot)
    assert [holder.slot for holder in holders] == [0, 1, 2]
    owners = [owner(mysql_uri, lock) for lock in slot_locks(key, 3)]
    before = session_ids(mysql_uri)
    ready, go = tmp_path / "head.ready", tmp_path / "head.go"
    head = spawn(*options, "-w", "forever", "--", "sh", "-c", HOLD.format(ready=ready, go=go))
    try:
        wait_for(lambda: len(waits_of(mysql_uri, head.pid)) == 3, what="the head's waits")
        assert holders[freed].finish() == 0
        wait_for(lambda: ready.exists() or head.poll() is not None, what="the head's command")
        assert int(ready.read_text()) == freed
        now_owners = [owner(mysql_uri, lock) for lock in slot_locks(key, 3)]
        mine = now_owners[freed]
        assert mine is not None
        assert mine not in owners  # a session of the head's
        # Its other sessions end; of the holders', only the one that finished is gone.
        wait_for(
            lambda: session_ids(mysql_uri) - before == {mine},
            timeout=SLACK,
            what="the head's helper sessions to end",
        )
        assert owners[freed] not in session_ids(mysql_uri)
        assert not waits_of(mysql_uri, head.pid)
        assert now_owners.count(mine) == 1
        assert [now_owners[slot] for slot in range(3) if slot != freed] == [
            owners[slot] for slot in range(3) if slot != freed
        ]
        assert owner(mysql_uri, f"{key}:gate") is None
    finally:
        go.touch()
    assert finish(head) == 0


# -- 9, 10: --slots agreement and exclusion ------------------------------------------------------


@pytest.mark.timeout(30)
def test_three_slots_on_a_mutex_exit_78_naming_the_holder(
    mysql_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """-s 3 on a name held with -s 1 exits 78 naming the holder, which runs on to exit 0."""
    key = lock_key("default", name)
    holder = held("--uri", mysql_uri, *CALM, "-n", name)
    result = lockrun("--uri", mysql_uri, *CALM, "-n", name, "-s", "3", "--", "true")
    assert result.returncode == 78, result.stderr
    line = one_line(result.stderr)
    assert name in line
    assert f"pid {holder.process.pid}" in line
    assert "--slots 1" in line
    assert holder.process.poll() is None
    assert [owner(mysql_uri, lock) for lock in slot_locks(key, 3)][1:] == [None, None]
    # The refused try left no record of its own: only the holder's slot 0.
    assert query(mysql_uri, "SELECT slot FROM lockrun_holders WHERE lock_key = %s", (key,)) == (
        (0,),
    )
    assert holder.finish() == 0


@pytest.mark.timeout(30)
def test_mutex_on_a_three_slot_name_exits_78_naming_the_holder(
    mysql_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """-s 1 on a name held with -s 3 exits 78 naming the holder, which runs on to exit 0."""
    holder = held("--uri", mysql_uri, *CALM, "-n", name, "-s", "3")
    result = lockrun("--uri", mysql_uri, *CALM, "-n", name, "--", "true")
    try:
        assert result.returncode == 78, result.stderr
        line = one_line(result.stderr)
        assert f"pid {holder.process.pid}" in line
        assert "--slots 3" in line
    finally:
        assert holder.process.poll() is None
        assert holder.finish() == 0


@pytest.mark.timeout(120)
def test_two_slots_never_hold_three(mysql_uri: str, name: str, tmp_path: Path) -> None:
    """8 processes × 3 acquisitions of -s 2 -w forever: never 3 at once, 2 at once at least once."""
    options = ("--uri", mysql_uri, *CALM, "-n", name)
    runs, slots, peak = interval_log(tmp_path, options, slots=2, rounds=3)
    assert slots <= {0, 1}
    assert runs == 24
    assert peak == 2


# -- 11: the server goes away under a waiter -----------------------------------------------------


@pytest.mark.timeout(60)
def test_waiter_whose_server_restarts_queues_again_with_a_larger_fence(
    maria_server: MariaServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A restart under a queued -w 30 waiter: it connects and queues again, runs, fence larger.

    The restart freed every lock, so the waiter gets in at once, while the old holder's
    command runs on until its next ownership check (≤ ttl/3) and its grace: that overlap is
    what any newcomer after a restart would get too (README "Restart, crash, failover"), and
    the fence tells the two apart. The old holder is stopped (76). A 69 without running the
    command would also be sane; running without a fence would not.
    """
    uri = maria_server.uri
    victim = Victim(tmp_path)
    holder = victim.start(spawn, "--uri", uri, *LEASE, "-n", name)
    argv, log, go = command(tmp_path, "waiter", other=victim.pid_file)
    go.touch()
    waiter = spawn("--uri", uri, *LEASE, "-n", name, "-w", "30", "--", *argv)
    wait_for(lambda: waits_of(uri, waiter.pid), what="the waiter to queue")
    restarted = time.time()
    maria_server.restart()
    _, err = waiter.communicate(timeout=30)
    _, holder_err = holder.communicate(timeout=TTL / 3 + KILL_AFTER + SLACK)
    check_lost(holder.returncode, holder_err, name)
    assert victim.term_file.exists(), "the old holder's command was not sent TERM"
    assert gone(victim.pid)
    print(f"waiter exited {waiter.returncode}: {err.strip()}")
    if waiter.returncode == 0:
        run = read_run(log)
        print(
            f"the waiter's command started {run.start - restarted:.2f}s after the restart began "
            f"({run.verdict}); the old holder's command got TERM (and exited) "
            f"{victim.term_time() - run.start:+.2f}s from then"
        )
        assert run.start > restarted
        assert run.fence > victim.fence
    else:
        assert waiter.returncode == 69, err
        assert name in one_line(err)
        assert not log.exists()
