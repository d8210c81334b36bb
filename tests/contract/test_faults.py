"""Faults under a holder on every server backend: lost sessions, restarts, kills, pauses, cuts.

Each test holds a lock through lockrun on a real server and breaks something underneath it
through the backend's `Harness` (tests/support/harness.py): the server forgets the lease or
ends the holding session, restarts, or stops answering behind a silent proxy; or lockrun
itself is SIGKILLed or frozen. Then it checks docs/design.md's promises with independent
evidence: files the commands write (with Unix-time stamps), /proc, pidfds, and the server's
own view of who holds the lock and until when. Where backends differ it is by what the
registry says they hold a lock with (`kind.leased`: a lease that runs out on the server's
clock; `kind.session`: a session that ends at once when its connection does), or by a
harness's own expectation. Leases are short (2–3 s, `--kill-after 1`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.support.cli import finish, lockrun, wait_for
from tests.support.harness import (
    CALM,
    KILL_AFTER,
    LEASE,
    SLACK,
    TTL,
    Harness,
    Run,
    Victim,
    check_lost,
    command,
    read_run,
    wait_for_death,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

GRACE: Final = 2.0  # how late after ttl/3 a lost lock may be noticed and acted on
# README "The server does not answer": lockrun gives up at last renewal + 0.9 × ttl − kill-after
# "so that KILL lands a tenth of a ttl before the server can hand the lock to someone else".
PROMISED_SHARE: Final = 0.1
TIMER_SLACK: Final = 0.1  # how late a timer of lockrun's may fire on a busy machine


# -- the server forgets the holder ---------------------------------------------------------------


@pytest.mark.parametrize("cut", ["end_session", "restart"])
@pytest.mark.parametrize("exit_on_term", [True, False], ids=["exits-on-TERM", "ignores-TERM"])
def test_the_server_takes_the_lock_away_and_the_holder_exits_76(
    server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    cut: str,
    exit_on_term: bool,
) -> None:
    """The server forgets the holder, or restarts: TERM at once, exit 76; the next fence is larger.

    Redis forgets the lease (FLUSHALL), MySQL KILLs the holding connection, PostgreSQL
    terminates its backend; or the server restarts mid-hold (TCP). The hang-up, or the next
    renewal (≤ ttl/3), finds it: TERM at once. The loss is certain, so a command deaf to
    TERM is KILLed within --lost-kill-after (1 s by default), not --kill-after (10 s here),
    plus on a lease the time until the next renewal finds it gone (up to ttl/3: README
    "Guarantees"). Then the server knows neither the holder nor the lock; what it kept
    through a restart (Redis and MySQL nothing, not even the fence: the clock seeds it) is
    the harness's to check.
    """
    harness = server_harness
    if cut == "restart" and not harness.restart_frees:
        pytest.skip(f"{harness.backend} keeps its locks across a restart")
    victim = Victim(tmp_path, exit_on_term=exit_on_term)
    lease = ("--ttl", f"{TTL:g}", "--kill-after", f"{KILL_AFTER if exit_on_term else 10.0:g}")
    process = victim.start(spawn, "--uri", harness.uri, *lease, "-n", name)
    holding = harness.holder(name)
    assert holding is not None
    pidfd = os.pidfd_open(victim.pid)
    try:
        cut_at = time.time()
        args = (name,) if cut == "end_session" else ()
        cutting = threading.Thread(target=getattr(harness, cut), args=args)
        cutting.start()
        died = wait_for_death(pidfd, cut_at + TTL / 3 + KILL_AFTER + SLACK + 10)
        cutting.join(60)
    finally:
        os.close(pidfd)
    assert died is not None, "the command was never stopped"
    status = process.wait(timeout=KILL_AFTER + SLACK)
    elapsed = time.time() - cut_at
    _, err = process.communicate(timeout=10)
    victim.check_stopped()
    term = victim.term_time() - cut_at
    record(f"{cut} mid-hold", term_after=term, stopped_after=died - cut_at, exited_after=elapsed)
    assert term < TTL / 3 + GRACE
    assert died - cut_at < (TTL / 3 if harness.kind.leased else 0.0) + 1 + SLACK
    assert elapsed < TTL / 3 + (GRACE if exit_on_term else KILL_AFTER + SLACK)
    check_lost(status, err, name, harness.lost_reason)
    assert harness.holder(name) is None
    assert not harness.alive(name, holding)
    if cut == "restart":
        harness.after_restart(name, victim.fence)
    second = lockrun("--uri", harness.uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert second.returncode == 0, second.stderr
    assert int(second.stdout) > victim.fence


@pytest.mark.parametrize("outage", [0.0, 2.0], ids=["restart", "down-2s"])
def test_a_queued_waiter_rides_out_a_restart_and_gets_a_larger_fence(
    server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    outage: float,
) -> None:
    """A restart under a queued waiter: it connects and queues again, runs (0), fence larger.

    The holder, on the unix socket, is stopped (76). The waiter, over TCP, rides out a lost
    server for a ttl of its own (README "A queued waiter that loses the server"), here a
    long one: a restart may take seconds on a loaded machine. With an *outage* the server
    refuses connections for 2 s first. A session's end is heard at once, so the waiter's
    command finds the old one gone; a Redis that restarts without its data has forgotten
    the lease, and the waiter may get in before the holder's next renewal finds that out
    (README "Restart without persistence, failover"): the fence tells the two apart, and
    the overlap is bounded by that renewal and --lost-kill-after.
    """
    harness = server_harness
    if not outage and not harness.restart_frees:  # the holder keeps its lease: nothing moves
        pytest.skip(f"{harness.backend} keeps its locks across a restart")
    victim = Victim(tmp_path)
    holder = victim.start(spawn, "--uri", harness.socket_uri, *LEASE, "-n", name)
    argv, log, go = command(tmp_path, "waiter", other=victim.pid_file)
    go.touch()
    patient = ("--ttl", "60", "-n", name, "-w", "forever")
    waiter = spawn("--uri", harness.uri, *patient, "--", *argv)
    wait_for(lambda: harness.waits(name, waiter.pid), 30, "the waiter to queue")
    pidfd = os.pidfd_open(victim.pid)
    try:
        restarted = time.time()
        harness.restart(outage)
        back = time.time()
        died = wait_for_death(pidfd, back + TTL / 3 + KILL_AFTER + SLACK)
    finally:
        os.close(pidfd)
    _, holder_err = holder.communicate(timeout=KILL_AFTER + SLACK)
    _, err = waiter.communicate(timeout=60)
    victim.check_stopped()
    assert died is not None
    check_lost(holder.returncode, holder_err, name, harness.lost_reason)
    assert waiter.returncode == 0, err
    run = read_run(log)
    record(
        "restart",
        stopped_after=died - restarted,
        server_back_after=back - restarted,
        margin=run.begun - died,
    )
    assert died - restarted < TTL / 3 + KILL_AFTER + SLACK + outage
    assert run.begun > restarted
    assert run.fence > victim.fence
    if harness.kind.session:  # the hang-up stopped it before the server was even back
        assert run.verdict == "alone", run
    detection = TTL / 3 if harness.kind.leased else 0.0
    assert max(0.0, died - run.begun) < detection + 1 + SLACK


# -- lockrun dies or freezes -----------------------------------------------------------------------


def test_sigkilled_holder_takes_its_command_along_and_the_waiter_gets_in(
    shared_server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """SIGKILL of a holder: the guardian kills its command; a waiter gets in, alone.

    A lease is released by the guardian once the command is dead, before its server-side
    end; a session ends with the guardian, which keeps its socket. Either way the waiter's
    command starts after the first one's last heartbeat, and finds it gone.
    """
    harness = shared_server_harness
    ttl = 10.0
    options = ("--uri", harness.uri, "-n", name)
    first_argv, first_log, first_go = command(tmp_path, "first")
    # stderr not piped: a surviving command would hold the pipe open.
    holder = spawn(*options, "--ttl", f"{ttl:g}", "--", *first_argv, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: first_log.exists() or holder.poll() is not None, what="the first command")
        first_pid = read_run(first_log).pid
        second_argv, second_log, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        waiter = spawn(*options, *CALM, "-w", "forever", "--", *second_argv)
        wait_for(lambda: harness.waits(name, waiter.pid), what="the waiter to queue")
        expires = harness.expiry(name, ttl)  # a lease ends no earlier than this
        pidfd = os.pidfd_open(first_pid)
        try:
            killed_at = time.time()
            holder.send_signal(signal.SIGKILL)
            died = wait_for_death(pidfd, killed_at + 5)
        finally:
            os.close(pidfd)
        assert died is not None, "the guardian did not kill the command"
        assert finish(waiter, timeout=ttl + SLACK + 10) == 0
    finally:
        first_go.touch()  # whatever failed, no loop is left running
    first, second = read_run(first_log), read_run(second_log)
    print(
        f"SIGKILL → first command seen dead after {died - killed_at:.3f}s; the waiter's "
        f"command started {second.begun - died:.3f}s after that"
    )
    assert second.verdict == "alone"
    assert second.begun > first.last  # [begun, last] intervals do not overlap
    assert second.fence > first.fence
    if harness.kind.leased:  # freed, not run out (G5); with a ttl of 10 s, not a race
        assert expires is not None
        assert second.begun < expires


@pytest.mark.parametrize(
    ("exit_on_term", "whole_job"),
    [(True, False), (False, False), (True, True)],
    ids=["lockrun", "lockrun-deaf-command", "lockrun-and-command"],
)
def test_paused_holder_loses_the_lock_after_a_ttl_and_stops_its_command_on_resume(
    shared_server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    exit_on_term: bool,
    whole_job: bool,
) -> None:
    """SIGSTOP of a holder: the server frees the lock a ttl after it last heard; 76 on SIGCONT.

    A queued waiter gets in no earlier than the server's expiry of the holder (a session's
    idle timer may fire a tenth of a ttl early) and not much later than a ttl; the server
    has forgotten the frozen holder; on SIGCONT it exits 76 and its command had TERM; the
    newer holder's fence is larger. The guardian, which is not frozen, stops the command
    before the lease runs out — with KILL if it ignores TERM — so the waiter's command
    finds it gone. With *whole_job* the command's process group (the guardian with it) is
    frozen too, as a frozen machine would be, and continued first: that overlap is what no
    lease can prevent (README "Pauses"), and the fence is what tells the two holders apart.
    """
    harness = shared_server_harness
    victim = Victim(tmp_path, exit_on_term=exit_on_term)
    process = victim.start(spawn, "--uri", harness.uri, *LEASE, "-n", name)
    holding = harness.holder(name)
    assert holding is not None
    argv, log, go = command(tmp_path, "later", other=victim.pid_file)
    go.touch()
    waiter = spawn("--uri", harness.uri, *LEASE, "-n", name, "-w", "forever", "--", *argv)
    wait_for(lambda: harness.waits(name, waiter.pid), what="the waiter to queue")
    group = os.getpgid(victim.pid)
    assert group != os.getpgid(process.pid)
    if whole_job:
        os.killpg(group, signal.SIGSTOP)
    try:
        with harness.paused(process):
            stopped = time.time()
            # A check sent just before the stop may still be running: read the idle session.
            expiry = harness.settled_expiry(name, TTL)
            assert finish(waiter, timeout=TTL + SLACK + 10) == 0
            later = read_run(log)
            assert not harness.alive(name, holding)  # the server ended the idle session
    finally:
        if whole_job:
            os.killpg(group, signal.SIGCONT)
    last = expiry - harness.free_after(TTL)  # when the server last heard of the holder
    waited = later.begun - last
    record("pause", margin=later.begun - stopped, waited_after_last_word=waited)
    assert later.begun >= expiry - harness.early_share * TTL
    assert waited < TTL + SLACK
    assert later.fence > victim.fence
    status = process.wait(timeout=TTL / 3 + KILL_AFTER + SLACK)
    _, err = process.communicate(timeout=10)
    victim.check_stopped()
    line = check_lost(status, err, name)
    if not whole_job:
        assert later.verdict == "alone"
    if not exit_on_term:
        assert "guardian stopped the command" in line


# -- a partition -----------------------------------------------------------------------------------


def fresh(harness: Harness, name: str, ttl: float) -> bool:
    """Return whether a call of *name*'s holder reached the server in the last 0.2 s."""
    expiry = harness.expiry(name, ttl)
    return expiry is not None and expiry - time.time() > harness.free_after(ttl) - 0.2


def across(
    harness: Harness,
    spawn: Callable[..., subprocess.Popen[str]],
    tmp_path: Path,
    name: str,
    other: Path,
    patience: float,
) -> Callable[[], tuple[Run, list[float | None]]]:
    """Start the clients that wait for *name* on the server's side; return how to await them.

    A lockrun (-w forever) whose command notes whether *other*'s still runs; and, where the
    lock is a server session, a client of our own on the slot itself, with no lockrun in
    between: the moment the server let go. The function returned waits for both and
    returns the command's run and when our client had the lock.
    """
    argv, log, go = command(tmp_path, "direct", other=other)
    go.touch()
    direct = spawn("--uri", harness.uri, *CALM, "-n", name, "-w", "forever", "--", *argv)
    got: list[float | None] = []
    grab = threading.Thread(target=lambda: got.append(harness.grab(name, patience)))
    if harness.kind.session:
        grab.start()

    def done() -> tuple[Run, list[float | None]]:
        assert finish(direct, timeout=patience) == 0
        if harness.kind.session:
            grab.join(patience)
        return read_run(log), got

    return done


# C is the last call that got through; a session's server frees the slot ceil(ttl) after it,
# a lease ends ttl after it. lockrun doubts its lock a ttl/3 after a call hangs and gives up
# at C + 0.9 ttl − kill-after at the latest (README "The server does not answer").
@pytest.mark.parametrize(
    ("ttl", "kill_after", "exit_on_term", "thin"),
    [
        # TERM at C+1.7 (or sooner), the command exits; the server frees at C+3.
        pytest.param(TTL, KILL_AFTER, True, False, id="exits-on-TERM"),
        # Gives up at C+3.7, between two retries: KILL at C+5.4, 0.6 s before the end.
        pytest.param(6.0, 1.7, False, False, id="ignores-TERM"),
        # Gives up at C+4.3; a retry at C+4.x could hang past that, so the last one is at
        # C+3.x: KILL still at C+5.4.
        pytest.param(6.0, 1.1, False, True, id="ignores-TERM-retry-overruns"),
        # The check at C+0.67 hangs, doubted at C+1.33: TERM, KILL by C+1.8; freed at C+2.
        pytest.param(2.0, KILL_AFTER, False, False, id="ignores-TERM-short-ttl"),
        # --kill-after 10 does not fit a 3 s lease: TERM at C+2, KILL at C+2.7 (0.9 ttl).
        pytest.param(TTL, 10.0, False, False, id="ignores-TERM-kill-after-too-long"),
    ],
)
def test_partition_stops_the_command_before_the_server_frees_the_lock(
    server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    ttl: float,
    kill_after: float,
    exit_on_term: bool,
    thin: bool,
) -> None:
    """A silent partition: the command is dead before the server frees the lock; exit 76.

    The holder reaches the server through the proxy, which then drops every byte. The last
    call that got through sets the server's expiry; a lockrun on the server's side of the
    partition (-w forever) must start its command only after the partitioned one died,
    also when it ignores TERM, and no earlier than the expiry. Where a hung retry delays
    the give-up (*thin*), KILL should still land a tenth of a ttl before the expiry, as the
    README promises.
    """
    harness = server_harness
    assert harness.proxied is not None
    lease = ("--ttl", f"{ttl:g}", "--kill-after", f"{kill_after:g}")
    victim = Victim(tmp_path, exit_on_term=exit_on_term)
    process = victim.start(spawn, "--uri", harness.proxied, *lease, "-n", name)
    holding = harness.holder(name)
    pidfd = os.pidfd_open(victim.pid)  # readable once the command has exited
    try:
        # Cut just after a call went through, so that the next one is the first to hang.
        wait_for(lambda: fresh(harness, name, ttl), ttl + SLACK, "a call through the proxy")
        harness.partition()
        cut = time.time()
        time.sleep(0.2)  # a call the proxy was already forwarding has landed by now
        assert harness.holder(name) == holding
        expiry = harness.settled_expiry(name, ttl)  # set by the last call that got through
        others = across(harness, spawn, tmp_path, name, victim.pid_file, ttl + SLACK + 10)
        ended = wait_for_death(pidfd, expiry)
        overran = ended is None  # the kernel saw it alive at or after the expiry
        still = None if overran else harness.expiry(name, ttl)
        if ended is None:
            ended = wait_for_death(pidfd, expiry + ttl + SLACK)
        run, got = others()
        assert harness.holder(name) is None
    finally:
        os.close(pidfd)
    assert still is None or abs(still - expiry) < 0.05, "a call got through the partition"
    assert ended is not None, "the command was never stopped"
    status = process.wait(timeout=kill_after + SLACK)
    _, err = process.communicate(timeout=10)
    margin = expiry - ended  # a lower bound: we saw the end a little after it came
    term = expiry - victim.term_time() if victim.term_file.exists() else float("nan")
    report = (
        f"partition, ttl {ttl:g}, kill-after {kill_after:g}, command "
        f"{'exits on' if exit_on_term else 'ignores'} TERM: TERM {term:.3f}s and death (seen) "
        f"{margin:.3f}s before the server's expiry, the other command {run.begun - ended:.3f}s "
        f"after the death; lockrun exited {status}"
    )
    record("partition", stopped_after=ended - cut, margin=run.begun - ended, ttl=ttl)
    if thin:  # a retry that hung must not have delayed the stop
        assert margin >= PROMISED_SHARE * ttl - TIMER_SLACK, report
    if harness.kind.leased:  # a lease ends on the server's clock, to the millisecond
        assert not overran, f"the command outlived its lease (seen dead {-margin:.3f}s after it)"
        assert margin > 0, report
    assert ended - cut < ttl, "the command outlived its lease"
    assert run.verdict == "alone", report
    assert run.fence > victim.fence
    # The other lockrun's command, and a client of our own without lockrun in between (the
    # moment the server let go, where the lock is a session): docs/design.md, never both
    # "lock free" and "command running"; and the server kept the slot until the expiry.
    for taken in [run.begun, *got]:
        assert taken is not None, "the direct client never got the lock"
        assert taken - ended > 0, report
        assert taken > expiry - harness.early_share * ttl, report
    line = check_lost(status, err, name)
    assert "lease could not be confirmed" in line


def test_a_lease_lost_before_the_command_starts_is_76_and_nothing_runs(
    shared_server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """The server takes the lock away during a stall between the grant and the spawn.

    strace delays each pipe2(2), the last of which the supervisor makes just before its
    check of a lease that the stall has left due. The stall outlasts the lease (a Redis
    key's ttl, a session's idle timeout), so the server ends it even should the test's own
    end_session come late on a loaded machine: no budget. A lock lost is 76 wherever it
    is lost (docs/semantics.md "Exit status"); it said 69, as if the server were down.
    """
    harness = shared_server_harness
    assert harness.can_end_session
    stall = ["strace", "-f", "-qq", "-o", "/dev/null", "--seccomp-bpf"]
    stall += ["-e", "trace=pipe2", "-e", f"inject=pipe2:delay_enter={round((TTL + 1) * 1e6)}"]
    ran = tmp_path / "ran"
    argv = ("--uri", harness.uri, *LEASE, "-n", name, "-v", "--", "touch", str(ran))
    holder = spawn(*argv, under=stall)
    assert holder.stderr is not None
    acquired = holder.stderr.readline()  # -v: acquire() is over, the spawn is next
    assert acquired.startswith(f"lockrun: acquired {name} "), acquired
    # Late on a loaded machine, the server has ended it already (the stall outlasts the
    # lease), and the harness finds no holder to end: as good.
    with contextlib.suppress(AssertionError):
        harness.end_session(name)
    _, err = holder.communicate(timeout=60)  # a hang guard only
    check_lost(holder.returncode, err.splitlines()[-1], name, "nothing ran")  # -v's last
    assert not ran.exists()
