"""PostgreSQL faults while a lock is held or awaited: kills, pauses, restarts and partitions.

Each test runs lockrun against a real PostgreSQL and breaks something underneath it:
pg_terminate_backend of the holding session, SIGKILL or SIGSTOP of a holder or waiter, a
server restart (SIGQUIT, immediate shutdown), a silent network partition (tests/proxy.py),
signals while waiting. Then it checks SPEC §4.1–§4.6 with independent evidence: files the
commands write (with Unix-time stamps), /proc, pidfds, and the server's own view
(pg_stat_activity, pg_locks; a session is tied to its lockrun by the pid its statements'
comment names). Leases are short (2–3 s, `--kill-after 1`): the server ends a session that
idled for a ttl (idle_session_timeout), and lockrun proves ownership every ttl/3.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import psycopg
import pytest

from lockrun.backends.postgres import lock_key, slots_key
from tests.support.cli import (
    TEST_TTL,
    Held,
    finish,
    gone,
    interval_log,
    lockrun,
    one_line,
    queue_length,
    start,
    wait_for,
)
from tests.support.proxy import Proxy
from tests.test_redis_faults import Victim, check_lost, wait_for_death

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

    from tests.support.servers import PostgresServer

TTL: Final = 3.0  # seconds: ownership checks every second, idle_session_timeout 3 s
KILL_AFTER: Final = 1.0
# Where the lease length does not matter: statements may then take a second, which a
# machine busy with other test runs can need.
CALM: Final = ("--ttl", "10")
SLACK: Final = 3.0  # generous: a shared 2-core machine, and Python start-ups on the way
GRACE: Final = 2.0  # how late after ttl/3 a lost session may be noticed and acted on
LEASE: Final = ("--ttl", f"{TTL:g}", "--kill-after", f"{KILL_AFTER:g}")
# The server frees an idle session's locks idle_session_timeout = ttl after its last
# statement; nobody may get in much earlier than that (a tenth: timer granularity).
EARLY: Final = 0.9
NAMESPACE: Final = "default"


# -- the server's view, from sessions of our own -------------------------------------------------


def query(uri: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Run *sql* on a fresh session of our own (not lockrun's) and return every row."""
    with psycopg.connect(uri, autocommit=True, connect_timeout=10) as connection:
        return connection.execute(sql, params or None).fetchall()


# Every statement of lockrun's carries /* lockrun {json} */ naming the lockrun process.
TAG: Final = re.compile(r"/\* lockrun (\{.*\}) \*/", re.DOTALL)


def owner_of(statement: str) -> int | None:
    """Return the lockrun pid a statement's comment names, None if it names none."""
    match = TAG.search(statement)
    if match is None:
        return None
    try:
        return int(json.loads(match[1])["holder"]["pid"])
    except (ValueError, KeyError, TypeError):
        return None


class Backend(NamedTuple):
    """One client session of the server, as pg_stat_activity shows it."""

    pid: int  # the server process
    application: str
    state: str  # "active", "idle", …
    owner: int | None  # the lockrun process its last statement names
    since: float  # Unix time of its last state change (idle: when its last statement ended)
    now: float  # the server's clock when it was read


SESSIONS: Final = (
    "SELECT pid, coalesce(application_name, ''), coalesce(state, ''), coalesce(query, ''), "
    "coalesce(extract(epoch FROM state_change), 0)::float8, "
    "extract(epoch FROM clock_timestamp())::float8 FROM pg_stat_activity "
    "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
    "AND datname = current_database()"
)


def sessions(uri: str) -> list[Backend]:
    """Return every client session in lockrun's database but ours."""
    return [
        Backend(int(pid), app, state, owner_of(text), float(since), float(clock))
        for pid, app, state, text, since, clock in query(uri, SESSIONS)
    ]


def session(uri: str, pid: int) -> Backend | None:
    """Return server process *pid*'s session, None if it has ended."""
    found = [each for each in sessions(uri) if each.pid == pid]
    return found[0] if found else None


def sessions_of(uri: str, lockrun_pid: int) -> set[int]:
    """Return the server processes of every session lockrun *lockrun_pid* has open."""
    return {each.pid for each in sessions(uri) if each.owner == lockrun_pid}


def named(uri: str, name: str) -> list[int]:
    """Return the server processes whose application_name says they hold a slot of *name*."""
    rows = query(
        uri,
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s ORDER BY pid",
        f"lockrun:{name}:%",
    )
    return [int(pid) for (pid,) in rows]


class Advisory(NamedTuple):
    """One advisory lock, granted or awaited, as pg_locks shows it."""

    pid: int  # the server process
    classid: int
    objid: int
    subid: int  # 1: a bigint key (slot or gate); 2: an int pair (the shared (name, N) lock)
    granted: bool
    owner: int | None  # the lockrun process its session's last statement names

    @property
    def key(self) -> int:
        """The signed bigint key (meaningful for subid 1)."""
        key = self.classid << 32 | self.objid
        return key - (1 << 64) if key >= 1 << 63 else key


LOCKS: Final = (
    "SELECT l.pid, l.classid::bigint, l.objid::bigint, l.objsubid, l.granted, "
    "coalesce(a.query, '') FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.pid <> pg_backend_pid() AND l.database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database())"
)


def advisory(uri: str) -> list[Advisory]:
    """Return every advisory lock in lockrun's database, granted or awaited."""
    return [
        Advisory(int(pid), int(classid), int(objid), int(subid), bool(granted), owner_of(text))
        for pid, classid, objid, subid, granted, text in query(uri, LOCKS)
    ]


def waits_of(uri: str, lockrun_pid: int) -> dict[int, int]:
    """Return the sessions of lockrun *lockrun_pid* waiting for a key, and that key."""
    return {
        lock.pid: lock.key
        for lock in advisory(uri)
        if lock.owner == lockrun_pid and not lock.granted and lock.subid == 1
    }


def holder_of(uri: str, key: int) -> int | None:
    """Return the server process holding bigint *key*, None if it is free."""
    found = [
        lock.pid for lock in advisory(uri) if lock.subid == 1 and lock.granted and lock.key == key
    ]
    return found[0] if found else None


def slot_keys(name: str, slots: int) -> list[int]:
    """Return the keys of *name*'s slots 0 … slots-1."""
    return [lock_key(NAMESPACE, name, slot) for slot in range(slots)]


def gate_key(name: str) -> int:
    """Return the key of *name*'s gate (the queue of a semaphore)."""
    return lock_key(NAMESPACE, name, "gate")


class InternalError(AssertionError):
    """lockrun exited 70: an exception escaped it (a bug), not the status the test expects."""


def no_internal_error(status: int | None, err: str) -> None:
    """Raise `InternalError` if lockrun ended with an internal error (status 70)."""
    if status == 70 and "internal error" in err:
        raise InternalError(err.strip())


def lost(status: int, err: str, name: str) -> str:
    """Assert lockrun exited 76 with one line naming the lock (70 → `InternalError`)."""
    no_internal_error(status, err)
    return check_lost(status, err, name)


def stopped(pid: int) -> bool:
    """Return whether *pid* is stopped (SIGSTOP took effect)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"


# -- commands and their evidence -----------------------------------------------------------------


# A command that logs its pid, fence, slot and start (Unix ns), then a heartbeat every 2 ms
# until its go file exists, and a last stamp. With a third argument, another command's pid
# file: it also notes whether that command was still alive when this one started.
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
fence, slot = os.environ["LOCKRUN_FENCE"], os.environ["LOCKRUN_SLOT"]
with open(log + ".tmp", "w") as head:
    head.write(f"{os.getpid()} {fence} {slot} {started} {verdict}\\n")
os.rename(log + ".tmp", log)
with open(log, "a", buffering=1) as out:
    while not os.path.exists(go):
        out.write(f"{time.time_ns()}\\n")
        time.sleep(0.002)
    out.write(f"{time.time_ns()}\\n")
"""


class Run(NamedTuple):
    """What a `COMMAND` wrote: pid, fence, slot, start, verdict and its last sign of life."""

    pid: int
    fence: int
    slot: int
    begun: float  # Unix time: the command's first moment (date(1), before Python starts)
    start: float  # Unix time: when Python looked for the other command
    verdict: str  # "alone", "overlap" or "-"
    last: float  # Unix time of its last heartbeat


def read_run(log: Path) -> Run:
    """Parse a `COMMAND`'s log (a SIGKILL may have cut it short after any whole line)."""
    head, *beats = log.read_text().splitlines()
    pid, fence, slot, started, verdict = head.split()
    stamps = [int(beat) for beat in beats if beat.isdigit()]
    last = max(stamps, default=int(started))
    begun = int(log.with_suffix(".begun").read_text()) / 1e9
    return Run(int(pid), int(fence), int(slot), begun, int(started) / 1e9, verdict, last / 1e9)


def command(
    tmp_path: Path, label: str, *, other: Path | None = None
) -> tuple[list[str], Path, Path]:
    """Return the argv of a `COMMAND` labelled *label*, its log and its go file.

    A shell notes the first moment (Unix ns) in LABEL.begun and execs Python in its place
    (the same pid), so start-up time does not widen the margins measured.
    """
    script = tmp_path / "command.py"
    if not script.exists():
        script.write_text(COMMAND)
    log, go = tmp_path / f"{label}.log", tmp_path / f"{label}.go"
    begun = log.with_suffix(".begun")
    stamp = f'date +%s%N > {begun}.tmp; mv {begun}.tmp {begun}; exec "$@"'
    argv = ["sh", "-c", stamp, "sh", sys.executable, str(script), str(log), str(go)]
    if other is not None:
        argv.append(str(other))
    return argv, log, go


def most_at_once(runs: Iterable[Run]) -> int:
    """Return how many of *runs* ran at once at most ([begun, last] intervals)."""
    events = sorted(event for run in runs for event in ((run.begun, 1), (run.last, -1)))
    running = peak = 0
    for _, change in events:  # at one instant an end comes before a start
        running += change
        peak = max(peak, running)
    return peak


# -- 1, 3: the session or the server goes away under a holder -----------------------------------


def lose_the_session(
    uri: str,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[str]],
    cut: Callable[[int], object],
) -> tuple[Victim, int, str]:
    """Hold *name* on *uri*, end the holding session with *cut*, and check SPEC §4.3's stop.

    *cut* gets the holding server process (found by its application_name). The next
    ownership check (≤ ttl/3) fails: TERM at once, and lockrun exits within ttl/3 + grace.
    Times come from a pidfd on lockrun and the command's TERM trap. Returns the victim and
    lockrun's status and stderr, for `check_session_lost` once the rest is checked.
    """
    victim = Victim(tmp_path)
    process = victim.start(spawn, "--uri", uri, *LEASE, "-n", name)
    (backend,) = named(uri, name)
    assert holder_of(uri, slot_keys(name, 1)[0]) == backend
    pidfd = os.pidfd_open(process.pid)
    try:
        cut_at = time.time()
        cutting = threading.Thread(target=cut, args=(backend,))
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
    status = process.returncode
    print(f"session ended → TERM after {term:.2f}s, lockrun exited {status} after {elapsed:.2f}s")
    assert term < TTL / 3 + GRACE
    assert elapsed < TTL / 3 + GRACE
    return victim, status, err


def check_session_lost(status: int, err: str, name: str) -> None:
    """Assert the 76 of a holder whose session ended, with the reason in its one line."""
    line = lost(status, err, name)
    assert "the session holding the lock ended" in line


@pytest.mark.timeout(40)
def test_terminated_session_stops_the_command_and_exits_76(
    postgres_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """pg_terminate_backend of the holding session: TERM, exit 76 within ttl/3 + grace."""

    def terminate(backend: int) -> None:
        assert query(postgres_uri, "SELECT pg_terminate_backend(%s::int)", backend) == [(True,)]

    _, status, err = lose_the_session(postgres_uri, name, tmp_path, spawn, terminate)
    assert named(postgres_uri, name) == []
    assert holder_of(postgres_uri, slot_keys(name, 1)[0]) is None
    check_session_lost(status, err, name)


@pytest.mark.timeout(60)
def test_server_restart_stops_the_holder_and_the_next_fence_is_larger(
    pg_server: PostgresServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A restart mid-hold (TCP) stops the command (76); the next holder's fence is larger.

    The holder on the unix socket meets a restart in the queued-waiter test.
    """
    uri = pg_server.tcp_uri
    first, status, err = lose_the_session(uri, name, tmp_path, spawn, lambda _: pg_server.restart())
    second = lockrun("--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert second.returncode == 0, second.stderr
    print(f"fence before the restart {first.fence}, after {int(second.stdout)}")
    assert int(second.stdout) > first.fence
    check_session_lost(status, err, name)


# -- 2, 4, 5: processes that die or freeze without a word ----------------------------------------


@pytest.mark.timeout(40)
def test_sigkilled_holder_takes_its_command_along_and_the_waiter_gets_in_at_once(
    postgres_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """SIGKILL of a holder: the guardian kills its command, then the waiter gets in at once.

    The guardian keeps the holding session's socket, so the server frees the slot when the
    command's group (the guardian with it) is dead. The waiter's command starts within a
    second of the first command's death, after its last heartbeat, and finds it gone.
    """
    options = ("--uri", postgres_uri, "-n", name, *CALM)
    first_argv, first_log, first_go = command(tmp_path, "first")
    # stderr not piped: a surviving command would hold the pipe open.
    holder = spawn(*options, "--", *first_argv, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: first_log.exists() or holder.poll() is not None, what="the first command")
        first_pid = read_run(first_log).pid
        second_argv, second_log, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        waiter = spawn(*options, "-w", "forever", "--", *second_argv)
        wait_for(lambda: waits_of(postgres_uri, waiter.pid), what="the waiter to queue")
        pidfd = os.pidfd_open(first_pid)
        try:
            killed_at = time.time()
            holder.send_signal(signal.SIGKILL)
            died = wait_for_death(pidfd, killed_at + 5)
        finally:
            os.close(pidfd)
        assert died is not None, "the guardian did not kill the command"
        assert finish(waiter, timeout=20) == 0
    finally:
        first_go.touch()  # whatever failed, no loop is left running
    first, second = read_run(first_log), read_run(second_log)
    after_death = second.begun - died
    print(
        f"SIGKILL → first command seen dead after {died - killed_at:.3f}s; the waiter's "
        f"command started {after_death:.3f}s after that, {second.begun - first.last:.3f}s "
        "after the first one's last heartbeat"
    )
    assert after_death < 1.0
    assert second.verdict == "alone"
    assert second.begun > first.last  # [begun, last] intervals do not overlap
    assert second.fence > first.fence


@pytest.mark.timeout(40)
@pytest.mark.parametrize("whole_job", [False, True], ids=["lockrun", "lockrun-and-command"])
def test_paused_holder_loses_the_lock_after_a_ttl_and_stops_its_command_on_resume(
    postgres_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any], whole_job: bool
) -> None:
    """SIGSTOP of a holder: idle_session_timeout frees the lock a ttl after its last check.

    The waiter gets in no earlier than 0.9 ttl after the holder's last statement ended (as
    pg_stat_activity's state_change says) and not much later than a ttl; on SIGCONT the
    holder TERMs its command and exits 76; the newer holder's fence is larger. With
    *whole_job* the command's process group (the guardian with it) is stopped too, as a
    frozen machine would be, and continued first.
    """
    uri = postgres_uri
    victim = Victim(tmp_path)
    process = victim.start(spawn, "--uri", uri, *LEASE, "-n", name)
    (holding,) = named(uri, name)
    argv, log, go = command(tmp_path, "later")
    go.touch()
    waiter = spawn("--uri", uri, *LEASE, "-n", name, "-w", "forever", "--", *argv)
    wait_for(lambda: waits_of(uri, waiter.pid), what="the waiter to queue")
    group = os.getpgid(victim.pid)
    assert group != os.getpgid(process.pid)
    if whole_job:
        os.killpg(group, signal.SIGSTOP)
    process.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(process.pid), what="lockrun to stop")
        # A check sent just before the stop may still be running: read the idle session.
        wait_for(
            lambda: (row := session(uri, holding)) is not None and row.state == "idle",
            what="the holder's session to idle",
        )
        idle = session(uri, holding)
        assert idle is not None
        last = idle.since  # when the holder's last statement ended
        assert finish(waiter, timeout=TTL + SLACK + 10) == 0
        later = read_run(log)
        assert session(uri, holding) is None  # the server ended the idle session
    finally:
        if whole_job:
            os.killpg(group, signal.SIGCONT)
        process.send_signal(signal.SIGCONT)
    waited = later.begun - last
    print(f"paused holder: the waiter's command started {waited:.2f}s after its last check")
    assert EARLY * TTL <= waited < TTL + SLACK
    assert later.fence > victim.fence
    status = process.wait(timeout=TTL / 3 + KILL_AFTER + SLACK)
    _, err = process.communicate(timeout=10)
    assert victim.term_file.exists(), "the command was not sent TERM"
    assert gone(victim.pid)
    lost(status, err, name)


@pytest.mark.timeout(40)
def test_paused_head_waiter_is_passed_over_and_never_runs_without_the_lock(
    postgres_uri: str,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A frozen head waiter granted the lock loses it a ttl later; never runs meanwhile.

    The grant ends the head's pg_advisory_lock, so its session idles, and the server ends it
    after idle_session_timeout: the second waiter gets in about a ttl after the grant.
    Resumed while the second runs, the first must not run its command until the second's
    ended: it exits 69 without running, or queues again and runs after it.
    """
    uri = postgres_uri
    key = slot_keys(name, 1)[0]
    holder = held("--uri", uri, *LEASE, "-n", name)
    next_argv, next_log, next_go = command(tmp_path, "next")
    head_argv, head_log, head_go = command(tmp_path, "head", other=next_log)
    head_go.touch()
    options = ("--uri", uri, *LEASE, "-n", name, "-w", "forever", "--")
    head = spawn(*options, *head_argv)
    wait_for(lambda: waits_of(uri, head.pid), what="the head waiter")
    (head_session,) = waits_of(uri, head.pid)
    second = spawn(*options, *next_argv)
    wait_for(lambda: waits_of(uri, second.pid), what="the second waiter")
    head.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: stopped(head.pid), what="the head waiter to stop")
        assert holder.finish() == 0
        # The server hands the lock to the frozen head's session, which cannot answer.
        wait_for(lambda: holder_of(uri, key) == head_session, what="the grant")
        wait_for(
            lambda: (row := session(uri, head_session)) is None or row.state == "idle",
            what="the granted session to idle",
        )
        idle = session(uri, head_session)
        assert idle is not None, "the granted session ended at once"
        granted = idle.since
        wait_for(next_log.exists, timeout=TTL + SLACK, what="the second waiter's command")
        passed = read_run(next_log).begun - granted
        print(f"the second waiter got in {passed:.2f}s after the frozen head was granted")
        assert EARLY * TTL <= passed < TTL + SLACK
    finally:
        head.send_signal(signal.SIGCONT)
    try:  # the second still runs: the head must wait, or give up
        wait_for(
            lambda: head.poll() is not None or waits_of(uri, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        assert not head_log.exists(), "the resumed waiter runs its command beside the holder"
    finally:
        next_go.touch()
    assert finish(second) == 0
    _, err = head.communicate(timeout=SLACK + 10)
    print(f"the resumed head waiter exited {head.returncode}: {err.strip()}")
    no_internal_error(head.returncode, err)
    if head.returncode == 0:  # it queued again and ran after the second
        first_run, second_run = read_run(head_log), read_run(next_log)
        assert first_run.verdict == "alone"
        assert first_run.begun > second_run.last
        assert first_run.fence > second_run.fence
    else:  # it gave up (69), or counted the lock it never used as lost (76)
        assert head.returncode in {69, 76}, err
        assert name in one_line(err)
        assert not head_log.exists()


@pytest.mark.timeout(60)
def test_paused_semaphore_head_is_passed_over_and_never_exceeds_the_slots(
    postgres_uri: str, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """N = 2: a frozen head (gate + a wait on each slot) lets the queue move within a ttl.

    Its waits come in pieces of ttl/3; a freed slot may be granted to its frozen session.
    Either way its sessions idle and the server ends them, so the waiter behind it gets
    the gate and the free slot within ttl/3 + a ttl of the stop. Resumed, the head queues
    again (or exits 69) and runs only when a slot is free: the commands' own intervals never
    show more than 2 at once.
    """
    uri = postgres_uri
    gate = gate_key(name)
    options = ("--uri", uri, *LEASE, "-n", name, "-s", "2", "-w", "forever", "--")
    labels = ("a", "b", "head", "second")
    argvs = {label: command(tmp_path, label) for label in labels}
    go_files = [argvs[label][2] for label in labels]
    try:
        first = [spawn(*options, *argvs[label][0]) for label in ("a", "b")]
        wait_for(
            lambda: all(argvs[label][1].exists() for label in ("a", "b")),
            what="both holders' commands",
        )
        head = spawn(*options, *argvs["head"][0])
        wait_for(
            lambda: sorted(waits_of(uri, head.pid).values()) == sorted(slot_keys(name, 2)),
            what="the head's waits on both slots",
        )
        assert holder_of(uri, gate) in sessions_of(uri, head.pid)
        second = spawn(*options, *argvs["second"][0])
        wait_for(
            lambda: list(waits_of(uri, second.pid).values()) == [gate],
            what="the second waiter to queue on the gate",
        )
        head.send_signal(signal.SIGSTOP)
        paused = time.time()
        wait_for(lambda: stopped(head.pid), what="the head waiter to stop")
        argvs["a"][2].touch()  # slot 0 comes free while the head is frozen
        assert finish(first[0]) == 0
        second_log = argvs["second"][1]
        wait_for(
            second_log.exists, timeout=TTL / 3 + TTL + SLACK, what="the second waiter's command"
        )
        passed = read_run(second_log).begun - paused
        print(f"N=2: the waiter behind the frozen head got in {passed:.2f}s after the stop")
        assert passed < TTL / 3 + TTL + SLACK
        head.send_signal(signal.SIGCONT)
        wait_for(
            lambda: head.poll() is not None or waits_of(uri, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        # Both slots are taken (b, second): the head must not run.
        assert not argvs["head"][1].exists(), "the resumed head runs beside two holders"
        argvs["b"][2].touch()
        assert finish(first[1]) == 0
        if head.poll() is None:
            wait_for(argvs["head"][1].exists, timeout=SLACK, what="the resumed head's command")
    finally:
        for go in go_files:
            go.touch()
    assert finish(second) == 0
    _, err = head.communicate(timeout=SLACK + 10)
    print(f"the resumed semaphore head exited {head.returncode}: {err.strip()}")
    logs = [argvs[label][1] for label in labels]
    runs = [read_run(log) for log in logs if log.exists()]
    assert most_at_once(runs) <= 2
    no_internal_error(head.returncode, err)
    if head.returncode != 0:  # it gave up (69), or counted the lock it never used as lost (76)
        assert head.returncode in {69, 76}, err
        assert name in one_line(err)
        assert not argvs["head"][1].exists()


# -- 6: a partition ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ttl", "kill_after", "exit_on_term"),
    [
        # The last good check at C; the next (C+1) hangs, doubted at C+2: TERM; the server
        # frees the slot at C+3 (idle_session_timeout).
        pytest.param(TTL, KILL_AFTER, True, id="exits-on-TERM"),
        # --kill-after 10 does not fit a 3 s lease: TERM at C+2, KILL at C+2.7 (0.9 ttl).
        pytest.param(TTL, 10.0, False, id="ignores-TERM-kill-after-too-long"),
        # The check at C+0.67 hangs, doubted at C+1.67: TERM, KILL at C+1.8; freed at C+2.
        pytest.param(2.0, KILL_AFTER, False, id="ignores-TERM-short-ttl"),
    ],
)
def test_partition_kills_the_command_before_the_server_frees_the_lock(
    pg_server: PostgresServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    ttl: float,
    kill_after: float,
    exit_on_term: bool,
) -> None:
    """A silent partition: the command is dead before the server frees the lock; exit 76.

    The server frees the slot idle_session_timeout = ttl after the last statement it got;
    a lockrun waiting on the server's side of the partition (-w forever) must start its
    command only after the partitioned one died.
    """
    key = slot_keys(name, 1)[0]
    lease = ("--ttl", f"{ttl:g}", "--kill-after", f"{kill_after:g}")
    with contextlib.closing(Proxy(("127.0.0.1", pg_server.port))) as proxy:
        through = f"postgresql://lockrun@127.0.0.1:{proxy.port}/lockrun"
        victim = Victim(tmp_path, exit_on_term=exit_on_term)
        process = victim.start(spawn, "--uri", through, *lease, "-n", name)
        (holding,) = named(pg_server.uri, name)
        pidfd = os.pidfd_open(victim.pid)  # readable once the command has exited
        try:
            # Cut just after a check went through, so the next one is the first to hang.
            wait_for(
                lambda: (
                    (row := session(pg_server.uri, holding)) is not None
                    and row.state == "idle"
                    and row.now - row.since < 0.1
                ),
                timeout=ttl / 3 + SLACK,
                what="an ownership check through the proxy",
            )
            proxy.blackhole()
            time.sleep(0.1)  # a check the proxy was already forwarding has landed by now
            idle = session(pg_server.uri, holding)
            assert idle is not None
            assert idle.state == "idle"
            last = idle.since  # the server frees the slot a ttl after this
            argv, log, go = command(tmp_path, "direct", other=victim.pid_file)
            go.touch()
            direct = spawn("--uri", pg_server.uri, *CALM, "-n", name, "-w", "forever", "--", *argv)
            ended = wait_for_death(pidfd, last + ttl + SLACK)
            assert finish(direct, timeout=ttl + SLACK + 10) == 0
        finally:
            os.close(pidfd)
        status = process.wait(timeout=kill_after + SLACK)
        _, err = process.communicate(timeout=10)
        assert holder_of(pg_server.uri, key) is None
    assert ended is not None, "the command was never stopped"
    run = read_run(log)
    margin = run.begun - ended  # a lower bound: we saw the death a little after it came
    term = victim.term_time() - last if victim.term_file.exists() else float("nan")
    report = (
        f"partition, ttl {ttl:g}, kill-after {kill_after:g}, command "
        f"{'exits on' if exit_on_term else 'ignores'} TERM: after the last check that got "
        f"through: TERM at +{term:.2f}s, death seen at +{ended - last:.2f}s, the other "
        f"command started at +{run.begun - last:.2f}s; margin {margin:.3f}s; lockrun exited "
        f"{status}"
    )
    print(report)
    assert run.begun - last >= EARLY * ttl, report  # the server kept the slot for a ttl
    assert margin > 0, report  # SPEC §4.2: never both "lock free" and "command running"
    assert run.verdict == "alone", report
    assert run.fence > victim.fence
    line = lost(status, err, name)
    assert "lease could not be confirmed" in line


# -- 7, 10: waiters that give up or get in leave nothing behind ----------------------------------


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    ("signo", "slots", "behind"),
    [
        pytest.param(signal.SIGINT, 1, False, id="INT-mutex-head"),
        pytest.param(signal.SIGTERM, 1, True, id="TERM-mutex-queued"),
        pytest.param(signal.SIGTERM, 3, False, id="TERM-semaphore-head"),
        pytest.param(signal.SIGINT, 3, True, id="INT-semaphore-queued"),
    ],
)
def test_interrupted_waiter_leaves_no_session_and_no_gate(
    postgres_uri: str,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., Any],
    signo: signal.Signals,
    slots: int,
    behind: bool,
) -> None:
    """INT/TERM while waiting: 130/143 with one line; its sessions and waits leave the server.

    As head of an N = 3 queue the waiter holds the gate and waits on every slot with 3
    sessions; queued *behind* another waiter it waits on the gate (N = 1: on slot 0). Within
    2 s of the signal none of its sessions is left, nothing waits or is held for it, the
    waiter ahead keeps its place, and once everyone finishes nothing is held at all.
    """
    uri = postgres_uri
    gate, keys = gate_key(name), slot_keys(name, slots)
    options = ("--uri", uri, *CALM, "-n", name, "-s", str(slots))
    holders = [held(*options) for _ in range(slots)]
    head_waits = sorted(keys)
    ahead = None
    if behind:
        ahead = spawn(*options, "-w", "forever", "--", "true")
        wait_for(
            lambda: sorted(waits_of(uri, ahead.pid).values()) == head_waits,
            what="the waiter ahead",
        )
    waiter = spawn(*options, "-w", "forever", "--", "true")
    expected = [gate] if behind and slots > 1 else head_waits
    wait_for(
        lambda: sorted(waits_of(uri, waiter.pid).values()) == expected, what="the waiter's waits"
    )
    mine = sessions_of(uri, waiter.pid)
    assert mine == waits_of(uri, waiter.pid).keys()  # every session of it waits
    if slots > 1:
        assert holder_of(uri, gate) in sessions_of(uri, ahead.pid if ahead else waiter.pid)
    signalled = time.monotonic()
    waiter.send_signal(signo)
    _, err = waiter.communicate(timeout=10)
    assert waiter.returncode == 128 + signo, err
    line = one_line(err)
    assert name in line
    assert "nothing is held" in line

    others = set() if ahead is None else sessions_of(uri, ahead.pid)

    def left() -> list[object]:
        backends = {each.pid for each in sessions(uri)}
        locks = [
            lock
            for lock in advisory(uri)
            if lock.pid in mine
            or lock.owner == waiter.pid
            # nothing but the waiter ahead waits on the name's keys
            or (not lock.granted and lock.key in {*keys, gate} and lock.pid not in others)
        ]
        return [*(mine & backends), *sessions_of(uri, waiter.pid), *locks]

    wait_for(lambda: not left(), timeout=GRACE + 0.5, what="the waiter's sessions to end")
    print(f"the waiter's sessions were gone {time.monotonic() - signalled:.2f}s after {signo!r}")
    if ahead is not None:  # the waiter ahead keeps its place and its gate
        assert sorted(waits_of(uri, ahead.pid).values()) == head_waits
        if slots > 1:
            assert holder_of(uri, gate) in sessions_of(uri, ahead.pid)
    elif slots > 1:
        assert holder_of(uri, gate) is None
    assert [holder.finish() for holder in holders] == [0] * slots
    if ahead is not None:
        assert finish(ahead) == 0
    assert [holder_of(uri, key) for key in [*keys, gate]] == [None] * (slots + 1)
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
    postgres_uri: str,
    name: str,
    held: Callable[..., Held],
    tmp_path: Path,
    spawn: Callable[..., Any],
    freed: int,
) -> None:
    """An N = 3 head waiter granted a slot: its helper sessions end, it holds that slot only.

    Slot 0 comes free on the head's first session (which also holds the gate); slot 2 on a
    helper. Either way the head keeps exactly one session, named lockrun:NAME:SLOT, holding
    that slot's key and the shared (name, 3) lock, and neither the gate nor anything else;
    the other holders' slots stay with their sessions.
    """
    uri = postgres_uri
    keys = slot_keys(name, 3)
    options = ("--uri", uri, *CALM, "-n", name, "-s", "3")
    holders = sorted((held(*options) for _ in range(3)), key=lambda holder: holder.slot)
    assert [holder.slot for holder in holders] == [0, 1, 2]
    owners = [holder_of(uri, key) for key in keys]
    assert None not in owners
    ready, go = tmp_path / "head.ready", tmp_path / "head.go"
    head = spawn(*options, "-w", "forever", "--", "sh", "-c", HOLD.format(ready=ready, go=go))
    try:
        wait_for(
            lambda: sorted(waits_of(uri, head.pid).values()) == sorted(keys),
            what="the head's waits",
        )
        assert len(sessions_of(uri, head.pid)) == 3
        assert holders[freed].finish() == 0
        wait_for(lambda: ready.exists() or head.poll() is not None, what="the head's command")
        assert int(ready.read_text()) == freed
        # Its helper sessions end: one session of the head's is left.
        wait_for(
            lambda: len(sessions_of(uri, head.pid)) == 1,
            timeout=SLACK,
            what="the head's helper sessions to end",
        )
        (mine,) = sessions_of(uri, head.pid)
        others = [owner for slot, owner in enumerate(owners) if slot != freed]
        assert named(uri, name) == sorted([*(owner or 0 for owner in others), mine])
        row = session(uri, mine)
        assert row is not None
        assert row.application == f"lockrun:{name}:{freed}"
        held_locks = [lock for lock in advisory(uri) if lock.pid == mine]
        assert all(lock.granted for lock in held_locks), held_locks
        assert sorted(
            (lock.subid, lock.key if lock.subid == 1 else lock.objid) for lock in held_locks
        ) == [
            (1, keys[freed]),
            (2, 3),
        ]
        (pair,) = [lock for lock in held_locks if lock.subid == 2]
        assert pair.classid == slots_key(NAMESPACE, name) & 0xFFFF_FFFF
        assert holder_of(uri, gate_key(name)) is None
        assert not waits_of(uri, head.pid)
        now_owners = [holder_of(uri, key) for key in keys]
        assert now_owners[freed] == mine
        assert [now_owners[slot] for slot in range(3) if slot != freed] == [
            owners[slot] for slot in range(3) if slot != freed
        ]
    finally:
        go.touch()
    assert finish(head) == 0


# -- 8: the server goes away under a waiter ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("outage", [0.0, 2.0], ids=["restart", "down-2s"])
def test_waiter_whose_server_restarts_queues_again_and_runs(
    pg_server: PostgresServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    outage: float,
) -> None:
    """A restart under a queued waiter: it connects and queues again, runs (0), fence larger.

    The restart freed every lock, so the waiter gets in once the server is back, while the
    old holder's command runs on until its next ownership check (≤ ttl/3): the overlap any
    newcomer after a restart would get too, which the fence tells apart. The old holder is
    stopped (76). With an *outage* the server refuses connections for 2 s first, well
    within the waiter's ttl (10 s), for which it tries again.
    """
    uri = pg_server.uri
    victim = Victim(tmp_path)
    holder = victim.start(spawn, "--uri", uri, *LEASE, "-n", name)
    argv, log, go = command(tmp_path, "waiter", other=victim.pid_file)
    go.touch()
    waiter = spawn("--uri", uri, *CALM, "-n", name, "-w", "30", "--", *argv)
    wait_for(lambda: waits_of(uri, waiter.pid), what="the waiter to queue")
    restarted = time.time()
    pg_server.stop()
    time.sleep(outage)
    pg_server.start()
    print(f"the server was back after {time.time() - restarted:.2f}s")
    _, err = waiter.communicate(timeout=40)
    _, holder_err = holder.communicate(timeout=TTL / 3 + KILL_AFTER + SLACK)
    assert victim.term_file.exists(), "the old holder's command was not sent TERM"
    assert gone(victim.pid)
    print(f"the waiter exited {waiter.returncode}: {err.strip()}")
    if log.exists():
        run = read_run(log)
        print(
            f"the waiter's command started {run.begun - restarted:.2f}s after the restart "
            f"began ({run.verdict}); the old holder's command got TERM "
            f"{victim.term_time() - run.begun:+.2f}s from then"
        )
        assert run.begun > restarted
        assert run.fence > victim.fence
    lost(holder.returncode, holder_err, name)
    no_internal_error(waiter.returncode, err)
    assert waiter.returncode == 0, err
    assert log.exists()


# -- 9: exclusion --------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_slots_never_hold_three(postgres_uri: str, name: str, tmp_path: Path) -> None:
    """4 processes × 3 acquisitions of -s 2 -w forever: never 3 at once, 2 at once at least once.

    The conformance suite runs N = 3; with N = 2 the head waits on slot 0 on its own session
    and on slot 1 on one helper.
    """
    options = ("--uri", postgres_uri, "--ttl", TEST_TTL, "-n", name)
    runs, slots, peak = interval_log(tmp_path, options, slots=2, rounds=3, workers=4)
    assert slots <= {0, 1}
    assert runs == 12
    assert peak == 2


def test_a_head_takes_a_grant_whose_answer_arrives_in_two_pieces(
    pg_server: PostgresServer, name: str, held: Callable[..., Held]
) -> None:
    """The head of a semaphore queue takes a slot whose answer's end comes late (was 69)."""
    holders = [held("--uri", pg_server.uri, "-n", name, "-s", "2") for _ in range(2)]
    with contextlib.closing(Proxy(("127.0.0.1", pg_server.port), late_tail=0.2)) as proxy:
        through = f"postgresql://lockrun@127.0.0.1:{proxy.port}/lockrun"
        waiter = start("--uri", through, "-n", name, "-s", "2", "-w", "forever", "--", "true")
        wait_for(lambda: queue_length(pg_server.uri, name) == 1, what="the head to wait")
        holders[0].finish()
        _, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
