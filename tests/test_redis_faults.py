"""Redis faults while a lock is held or awaited: data loss, restarts, kills and partitions.

Each test runs lockrun against a real redis-server and breaks something underneath it:
FLUSHALL, a restart without persistence, SIGKILL of a holder or of the head waiter, a
silent network partition (tests/proxy.py), and then checks SPEC §4.2, §4.3 and §4.5 with
independent evidence: files the command writes, /proc, and the server's own keys and clock.
Leases are short (2–3 s, `--kill-after 1`; 6 s in two cases) so the file runs in ~35 s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.support.cli import (
    Held,
    finish,
    gone,
    holder_pids,
    lock_state,
    lockrun,
    one_line,
    start,
    wait_for,
    waiter_pids,
)
from tests.support.proxy import Proxy
from tests.support.servers import RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

TTL: Final = 3.0  # seconds: renewals every second
KILL_AFTER: Final = 1.0
SHORT_TTL: Final = 2.0  # for the tests that wait for a dead process's lease to run out
# Where the lease length does not matter: calls may then take 0.5 s (ttl/20), which a machine
# busy with other test runs can need.
CALM: Final = ("--ttl", "10")
SLACK: Final = 3.0  # generous: a shared 2-core machine, and Python start-ups on the way
LEASE: Final = ("--ttl", f"{TTL:g}", "--kill-after", f"{KILL_AFTER:g}")


def check_lost(status: int, err: str, name: str) -> str:
    """Assert lockrun exited 76 with one line naming the lock; return the line."""
    assert status == 76, err
    line = one_line(err)
    assert line.startswith(f"lockrun: {name}: "), line
    return line


# Every lockrun key and its PTTL, read in one atomic step (nothing changes in between).
KEYS_WITH_TTL: Final = """
local found = {}
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  found[#found + 1] = key
  found[#found + 1] = redis.call('PTTL', key)
end
return found
"""

# The second command's oracle: was the first command still running when this one started?
FIRST_STILL_RUNNING: Final = """
import sys, time
started = time.time()
pid = int(open(sys.argv[1]).read().split()[0])
try:
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
except FileNotFoundError:
    state = "gone"
print("overlap" if state not in {"Z", "X", "gone"} else "alone", started)
"""


@pytest.fixture
def tcp_redis() -> Iterator[RedisServer]:
    """Return a Redis of this test's own that also listens on a loopback TCP port."""
    server = RedisServer(port=free_port())
    yield server
    server.close()


@pytest.fixture
def proxy(tcp_redis: RedisServer) -> Iterator[Proxy]:
    """Return a proxy in front of `tcp_redis`'s TCP port, closed at teardown."""
    with contextlib.closing(Proxy(("127.0.0.1", tcp_redis.port))) as running:
        yield running


class Victim:
    """A `sh` command that publishes its pid and fence, logs TERM, and loops until killed."""

    def __init__(self, directory: Path, *, exit_on_term: bool = True) -> None:
        """Describe the script; *exit_on_term* False makes it survive TERM (only KILL ends it)."""
        self.pid_file = directory / "victim.pid"
        self.term_file = directory / "victim.term"
        on_term = f"date +%s%N > {self.term_file}" + ("; exit 0" if exit_on_term else "")
        # The shell reports its TERMed `sleep` ("Terminated") on stderr: keep that out of
        # lockrun's, which must hold exactly one line.
        self.script = (
            f"exec 2>>{directory / 'victim.err'}; trap '{on_term}' TERM; "
            f'echo "$$ $LOCKRUN_FENCE" > {self.pid_file}.tmp; '
            f"mv {self.pid_file}.tmp {self.pid_file}; "
            "while :; do sleep 0.05; done"
        )
        self.pid = 0
        self.fence = 0

    def start(
        self, spawn: Callable[..., subprocess.Popen[str]], *options: str
    ) -> subprocess.Popen[str]:
        """Start ``lockrun OPTIONS -- sh -c SCRIPT`` and wait until the command runs.

        With ttl 3 every Redis call may take 0.3 s; a machine busy with other test runs can
        miss that while lockrun acquires, before anything under test happens. Such a 69 is
        tried again (twice); any other early exit fails the test with lockrun's stderr.
        """
        for _ in range(3):
            process = spawn(*options, "--", "sh", "-c", self.script)
            wait_for(functools.partial(self.started, process), what="the command")
            if self.pid_file.exists():
                pid, fence = self.pid_file.read_text().split()
                self.pid, self.fence = int(pid), int(fence)
                return process
            _, err = process.communicate(timeout=10)
            if process.returncode != 69:
                break
            print(f"lockrun could not acquire, trying again: {err}")
        pytest.fail(f"the command did not start (status {process.returncode}): {err}")

    def started(self, process: subprocess.Popen[str]) -> bool:
        """Return whether the command runs, or *process* (lockrun) ended without it."""
        return self.pid_file.exists() or process.poll() is not None

    def term_time(self) -> float:
        """Return the Unix time the command's TERM trap ran."""
        return int(self.term_file.read_text()) / 1e9


def leases(server: RedisServer, name: str) -> dict[str, float]:
    """Return *name*'s holders ZSET: each lease's token and its server-side end (Unix time)."""
    reply = server.command("ZRANGE", f"lockrun:{{default/{name}}}:holders", "0", "-1", "WITHSCORES")
    lines = reply.splitlines()
    return {
        token: float(score) / 1000 for token, score in zip(lines[::2], lines[1::2], strict=True)
    }


def only_lease(server: RedisServer, name: str) -> tuple[str, float]:
    """Return the token and end of *name*'s one lease."""
    (lease,) = leases(server, name).items()
    return lease


def wait_for_death(pidfd: int, deadline: float) -> float | None:
    """Sleep until the process of *pidfd* exits; return the Unix time we woke to see it.

    None means it still ran when the kernel last looked, at or after *deadline* (Unix time).
    An exit wakes us at once (no polling interval), so the time returned is late only by
    our own scheduling delay.
    """
    while True:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.time()))
        if ready:
            return time.time()
        if time.time() >= deadline:
            return None


def lockrun_keys(server: RedisServer) -> dict[str, int]:
    """Return every ``lockrun:*`` key on *server* with its PTTL (-1: none)."""
    reply = server.command("EVAL", KEYS_WITH_TTL, "0", "lockrun:*").splitlines()
    return {key: int(pttl) for key, pttl in zip(reply[::2], reply[1::2], strict=True)}


# -- 1, 2: the server forgets the lease ----------------------------------------------------------


def lose_the_lease(
    server: RedisServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[str]],
    cut: Callable[[], object],
    *,
    exit_on_term: bool = True,
) -> Victim:
    """Hold *name*, make the server forget it with *cut*, and check SPEC §4.3's stop.

    The next renewal (≤ ttl/3) finds the lease gone: TERM at once, KILL after --kill-after,
    exit 76 with one line, so lockrun is done within ttl/3 + --kill-after of the cut (plus
    slack), whether or not the command obeys TERM.
    """
    victim = Victim(tmp_path, exit_on_term=exit_on_term)
    process = victim.start(spawn, "--uri", server.uri, *LEASE, "-n", name)
    cut_at = time.monotonic()
    cut()
    status = process.wait(timeout=TTL / 3 + KILL_AFTER + SLACK + 10)
    elapsed = time.monotonic() - cut_at
    _, err = process.communicate(timeout=10)
    assert victim.term_file.exists(), "the command was not sent TERM"
    assert gone(victim.pid)
    print(f"lease lost → lockrun exited {status} after {elapsed:.2f}s")
    assert elapsed < TTL / 3 + KILL_AFTER + SLACK
    check_lost(status, err, name)
    return victim


@pytest.mark.timeout(30)
def test_flushall_stops_the_command_and_exits_76(
    redis_server: RedisServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """FLUSHALL under a holder: the next renewal sees the loss, TERMs the command, exits 76."""
    lose_the_lease(redis_server, name, tmp_path, spawn, lambda: redis_server.command("FLUSHALL"))


@pytest.mark.timeout(30)
def test_restart_stops_the_command_and_the_next_fence_is_larger(
    redis_server: RedisServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A restart that loses the data stops the holder (76); the next fence is still larger."""
    first = lose_the_lease(redis_server, name, tmp_path, spawn, redis_server.restart)
    assert redis_server.command("EXISTS", f"lockrun:{{default/{name}}}:fence") == "0"
    second = lockrun("--uri", redis_server.uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert second.returncode == 0, second.stderr
    assert int(second.stdout) > first.fence


@pytest.mark.timeout(30)
def test_lost_lease_kills_a_command_that_ignores_term_and_exits_76(
    redis_server: RedisServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """FLUSHALL under a command that ignores TERM: KILL after --kill-after, still exit 76."""
    lose_the_lease(
        redis_server,
        name,
        tmp_path,
        spawn,
        lambda: redis_server.command("FLUSHALL"),
        exit_on_term=False,
    )


# -- 3, 4: processes that die without a word ------------------------------------------------------


@pytest.mark.timeout(40)
def test_sigkilled_holder_takes_its_command_along_and_the_waiter_gets_in(
    redis_server: RedisServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """SIGKILL of a holder: its command dies, a waiter gets in once the lease ran out.

    The guardian kills the command at once; the waiter (-w forever) starts within a ttl,
    never before the lease's server-side expiry, and never sees the first command alive.
    """
    options = ("--uri", redis_server.uri, "-n", name)
    pid_file, go = tmp_path / "first.pid", tmp_path / "go"
    script = (
        f"echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; "
        f"while [ ! -e {go} ]; do sleep 0.01; done"
    )
    checker = tmp_path / "check.py"
    checker.write_text(FIRST_STILL_RUNNING)
    # stderr not piped: a surviving command would hold the pipe open.
    holder = spawn(
        *options, "--ttl", f"{SHORT_TTL:g}", "--", "sh", "-c", script, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: pid_file.exists() or holder.poll() is not None, what="the first command")
        first_command = int(pid_file.read_text())
        waiter = spawn(
            *options,
            *CALM,
            "-w",
            "forever",
            "--",
            sys.executable,
            str(checker),
            str(pid_file),
            stdout=subprocess.PIPE,
        )
        wait_for(lambda: waiter_pids(redis_server.uri, name) == [waiter.pid], what="the waiter")
        (lease,) = lock_state(redis_server.uri, name)["holders"]
        killed_at = time.time()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        wait_for(lambda: gone(first_command), timeout=5, what="the guardian to kill the command")
        out, err = waiter.communicate(timeout=SHORT_TTL + SLACK + 10)
        assert waiter.returncode == 0, err
        verdict, started = out.split()
        assert verdict == "alone"
        waited = float(started) - killed_at
        print(f"waiter's command started {waited:.2f}s after the SIGKILL")
        # The lease ends no earlier than status said just before the kill; only then.
        assert float(started) >= lease["expires"]
        assert waited < SHORT_TTL + SLACK
    finally:
        go.touch()  # whatever failed, no loop is left running


def start_two_waiters(
    spawn: Callable[..., subprocess.Popen[str]],
    uri: str,
    name: str,
    tmp_path: Path,
    ttls: tuple[str, str],
) -> tuple[subprocess.Popen[str], subprocess.Popen[str], Path, Path]:
    """Queue a head waiter (`true`) and then a second one whose command logs its start.

    Returns both processes, the second command's start-time file and its go file.
    """
    head = spawn("--uri", uri, "-n", name, "--ttl", ttls[0], "-w", "forever", "--", "true")
    wait_for(lambda: waiter_pids(uri, name) == [head.pid], what="the head waiter")
    started, go = tmp_path / "second.started", tmp_path / "second.go"
    script = (
        f"date +%s%N > {started}.tmp; mv {started}.tmp {started}; "
        f"while [ ! -e {go} ]; do sleep 0.01; done"
    )
    second = spawn(
        "--uri", uri, "-n", name, "--ttl", ttls[1], "-w", "forever", "--", "sh", "-c", script
    )
    wait_for(lambda: waiter_pids(uri, name) == [head.pid, second.pid], what="the second waiter")
    return head, second, started, go


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_allowed", [True, False], ids=["passed-over", "no-CLIENT-acl"])
def test_sigkilled_head_waiter_is_passed_over(
    redis_server: RedisServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
    client_allowed: bool,
) -> None:
    """SIGKILL of the head waiter: the release passes it over; the next gets in at once.

    The release hands the slot to the dead head, sees that its connection is gone (CLIENT
    LIST) and hands it on. A Redis user without the CLIENT commands cannot see that: the
    slot then lapses within the dead head's ttl. Either way `status` then lists only the
    second waiter.
    """
    uri = redis_server.uri
    ttl = 20.0 if client_allowed else TTL  # at once is far less than a ttl
    if not client_allowed:
        redis_server.command(
            "ACL", "SETUSER", "noclient", "on", ">pw", "~*", "&*", "+@all", "-client"
        )
        uri += "?username=noclient&password=pw"
    holder = held("--uri", uri, "-n", name, "--ttl", f"{ttl:g}")
    head, second, started, go = start_two_waiters(spawn, uri, name, tmp_path, (f"{ttl:g}",) * 2)
    try:
        head.send_signal(signal.SIGKILL)
        head.wait(10)
        killed_at = time.time()
        assert holder.finish() == 0
        wait_for(started.exists, timeout=ttl + SLACK, what="the second waiter's command")
        waited = int(started.read_text()) / 1e9 - killed_at
        print(f"second waiter got in {waited:.2f}s after the head waiter's SIGKILL")
        assert 0 < waited < (SLACK if client_allowed else TTL + SLACK)
        if not client_allowed:
            assert waited > TTL / 4, "passed over without CLIENT LIST"  # lapses ttl/2–ttl on
        assert holder_pids(uri, name) == [second.pid]
        assert waiter_pids(uri, name) == []
    finally:
        go.touch()
    assert finish(second) == 0


@pytest.mark.timeout(40)
def test_dead_head_waiter_blocks_no_longer_than_its_own_ttl(
    redis_server: RedisServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A dead waiter blocks others at most its own ttl after its death (SPEC §4.5, README).

    Users of a name may choose different leases: the holder here has --ttl 30, the waiters
    --ttl 2. When the head waiter dies and the holder releases, the slot handed to the dead
    head must lapse within the head's own ttl, not the holder's.
    """
    uri = redis_server.uri
    holder = held("--uri", uri, "-n", name, "--ttl", "30")
    ttls = (f"{SHORT_TTL:g}",) * 2
    head, second, started, go = start_two_waiters(spawn, uri, name, tmp_path, ttls)
    try:
        head.send_signal(signal.SIGKILL)
        head.wait(10)
        killed_at = time.time()
        assert holder.finish() == 0
        for entry in lock_state(uri, name)["holders"]:
            if entry["pid"] == head.pid:  # granted to the dead head: only for its own lease
                ahead = entry["expires"] - killed_at
                assert ahead < SHORT_TTL + 0.5, f"dead waiter holds the slot {ahead:.1f}s on"
        wait_for(started.exists, timeout=SHORT_TTL + SLACK, what="the second waiter's command")
        assert int(started.read_text()) / 1e9 - killed_at < SHORT_TTL + SLACK
    finally:
        go.touch()
    assert finish(second) == 0


# -- 5: a partition ------------------------------------------------------------------------------

# README "The server does not answer": lockrun gives up at last renewal + 0.9 × ttl − kill-after
# "so that KILL lands a tenth of a ttl before the server can hand the lock to someone else".
PROMISED_SHARE: Final = 0.1
TIMER_SLACK: Final = 0.1  # how late a timer of lockrun's may fire on a busy machine


# Times after the last renewal that got through (C). With ttl 6 each call may take 0.3 s
# (ttl/20) to connect and 0.3 s to be answered; lockrun renews at C+2, which hangs, and asks
# again every second, but never later than 0.6 s (ttl/10) before it gives up at
# C + 5.4 − kill-after, so KILL lands at C+5.4 at the latest, 0.6 s before the lease ends.
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ttl", "kill_after", "exit_on_term", "thin"),
    [
        # TERM at C+1.7, the command exits; the lease ends at C+3.
        pytest.param(TTL, KILL_AFTER, True, False, id="exits-on-TERM"),
        # Gives up at C+3.7, between two retries: KILL at C+5.4, 0.6 s before the end.
        pytest.param(6.0, 1.7, False, False, id="ignores-TERM"),
        # Gives up at C+4.3; a retry at C+4.x could hang past that, so the last one is at
        # C+3.x: KILL still at C+5.4.
        pytest.param(
            6.0,
            1.1,
            False,
            True,
            id="ignores-TERM-retry-overruns",
        ),
    ],
)
def test_partition_stops_the_command_before_the_lease_ends_server_side(
    tcp_redis: RedisServer,
    proxy: Proxy,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    ttl: float,
    kill_after: float,
    exit_on_term: bool,
    thin: bool,
) -> None:
    """A silent partition stops the command before its lease ends server-side; exit 76.

    The last renewal that got through sets the expiry; the command is dead before it, also
    when it ignores TERM, and a client on the far side of the partition gets the lock only
    after the command died. Where a hung retry delays the give-up (*thin*), KILL should
    still land a tenth of a ttl before the expiry, as the README promises.
    """
    lease = ("--ttl", f"{ttl:g}", "--kill-after", f"{kill_after:g}")
    victim = Victim(tmp_path, exit_on_term=exit_on_term)
    process = victim.start(spawn, "--uri", proxy.uri, *lease, "-n", name)
    pidfd = os.pidfd_open(victim.pid)  # readable once the command has exited
    try:
        token, first_expiry = only_lease(tcp_redis, name)
        # Renewals pass through the proxy: the server-side expiry moves on.
        wait_for(
            lambda: leases(tcp_redis, name).get(token, 0) > first_expiry,
            timeout=ttl / 3 + SLACK,
            what="a renewal through the proxy",
        )
        proxy.blackhole()
        time.sleep(0.2)  # a renewal the proxy was already forwarding has landed by now
        assert only_lease(tcp_redis, name)[0] == token
        expiry = leases(tcp_redis, name)[token]  # set by the last renewal that got through
        checker = tmp_path / "check.py"
        checker.write_text(FIRST_STILL_RUNNING)
        second = spawn(
            "--uri",
            tcp_redis.uri,
            *lease,
            "-n",
            name,
            "-w",
            "forever",
            "--",
            sys.executable,
            str(checker),
            str(victim.pid_file),
            stdout=subprocess.PIPE,
        )
        ended = wait_for_death(pidfd, expiry)
        overran = ended is None  # the kernel saw it alive at or after the expiry
        if ended is None:
            ended = wait_for_death(pidfd, expiry + ttl + SLACK)
    finally:
        os.close(pidfd)
    assert leases(tcp_redis, name).get(token) in {expiry, None}, "a renewal got through"
    assert ended is not None, "the command was never stopped"
    status = process.wait(timeout=kill_after + SLACK)
    _, err = process.communicate(timeout=10)
    margin = expiry - ended  # a lower bound: we saw the end a little after it came
    term_margin = expiry - victim.term_time() if victim.term_file.exists() else float("nan")
    print(
        f"partition, ttl {ttl:g}, kill-after {kill_after:g}, command "
        f"{'exits on' if exit_on_term else 'ignores'} TERM: TERM {term_margin:.3f}s and death "
        f"(seen) {margin:.3f}s before the server-side expiry; lockrun exited {status}"
    )
    promised = PROMISED_SHARE * ttl
    if thin:  # a retry that hung must not have delayed the stop
        assert margin >= promised - TIMER_SLACK, f"KILL landed {margin:.3f}s before the end"
    # SPEC §4.2: never both "lock free" and "command running".
    assert not overran, f"the command outlived its lease (seen dead {-margin:.3f}s after it)"
    assert margin > 0, f"the command's end was seen {-margin:.3f}s after its lease ended"
    # The far side of the partition gets the lock only once the lease ran out, and its
    # command finds the first one gone.
    out, _ = second.communicate(timeout=ttl + SLACK + 10)
    assert second.returncode == 0
    verdict, started = out.split()
    assert verdict == "alone"
    assert float(started) > expiry
    assert float(started) > ended
    line = check_lost(status, err, name)
    assert "lease could not be confirmed" in line


# -- 6: nothing left behind ----------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_every_key_expires_and_only_the_fence_outlives_the_lock(
    redis_server: RedisServer,
    name: str,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """Every lockrun key expires, and after the last user only the fence is left.

    While the lock is held or awaited every key has a TTL; a failed try adds no key; SIGINT
    while waiting exits 130 and leaves no waiter; after release only the fence (with a TTL)
    remains.
    """
    uri = redis_server.uri
    prefix = f"lockrun:{{default/{name}}}"
    holder = held("--uri", uri, *CALM, "-n", name)
    holding = lockrun_keys(redis_server)
    assert f"{prefix}:holders" in holding
    assert all(pttl > 0 for pttl in holding.values()), holding

    busy = lockrun("--uri", uri, *CALM, "-n", name, "--", "true")
    assert busy.returncode == 75, busy.stderr
    assert lockrun_keys(redis_server).keys() == holding.keys()

    waiter = spawn("--uri", uri, *CALM, "-n", name, "-w", "forever", "--", "true")
    wait_for(lambda: waiter_pids(uri, name) == [waiter.pid], what="the waiter")
    waiting = lockrun_keys(redis_server)
    assert {f"{prefix}:queue", f"{prefix}:waiters"} <= waiting.keys()
    assert all(pttl > 0 for pttl in waiting.values()), waiting

    waiter.send_signal(signal.SIGINT)
    _, err = waiter.communicate(timeout=10)
    assert waiter.returncode == 130, err
    assert name in one_line(err)
    assert waiter_pids(uri, name) == []
    assert redis_server.command("ZCARD", f"{prefix}:queue") == "0"
    assert redis_server.command("ZCARD", f"{prefix}:waiters") == "0"
    left = lockrun_keys(redis_server)
    assert not [key for key in left if ":wake:" in key], left
    assert all(pttl > 0 for pttl in left.values()), left

    assert holder.finish() == 0
    after = lockrun_keys(redis_server)
    assert list(after) == [f"{prefix}:fence"]
    assert after[f"{prefix}:fence"] > 0


# -- 7: --slots must agree -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_slots_mismatch_exits_78_naming_the_holder(
    redis_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """-s 2 on a name held with -s 3 exits 78 naming the holder; once free, -s 2 works."""
    holder = held("--uri", redis_uri, *CALM, "-n", name, "-s", "3")
    result = lockrun("--uri", redis_uri, "-n", name, "-s", "2", "--", "true")
    assert result.returncode == 78, result.stderr
    line = one_line(result.stderr)
    assert name in line
    assert f"pid {holder.process.pid}" in line
    assert "--slots 3" in line
    assert holder.finish() == 0
    assert lockrun("--uri", redis_uri, "-n", name, "-s", "2", "--", "true").returncode == 0


@pytest.mark.timeout(40)
def test_a_queued_waiter_rides_out_a_server_restart(
    redis_server: RedisServer, name: str, held: Callable[..., Held]
) -> None:
    """A waiter queued when Redis restarts reconnects and gets the lock (no 69).

    The restart loses every lease: the old holder is stopped (76) and the waiter's fence is
    still larger than the old holder's.
    """
    uri = redis_server.uri
    holder = held("--uri", uri, "-n", name, *LEASE)
    waiter = start(
        "--uri",
        uri,
        "-n",
        name,
        *LEASE,
        "-w",
        "forever",
        "--",
        "sh",
        "-c",
        "echo $LOCKRUN_FENCE",
        stdout=subprocess.PIPE,
    )
    wait_for(lambda: waiter_pids(uri, name) == [waiter.pid], what="the waiter to queue")
    redis_server.restart()
    out, err = waiter.communicate(timeout=TTL + SLACK + 10)
    assert waiter.returncode == 0, err
    assert int(out) > holder.fence
    holder.process.communicate(timeout=TTL + SLACK)
    assert holder.process.returncode == 76


@pytest.mark.timeout(40)
def test_a_paused_holder_stops_its_command_when_it_resumes(
    redis_server: RedisServer, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A holder frozen past its lease: on SIGCONT it stops its command and exits 76.

    While lockrun is stopped another holder gets in, with a larger fence.

    The overlap while lockrun is frozen is what no lease can prevent (README "Pauses");
    the fence is what lets the resource tell the two holders apart.
    """
    victim = Victim(tmp_path)
    process = victim.start(spawn, "--uri", redis_server.uri, *LEASE, "-n", name)
    process.send_signal(signal.SIGSTOP)
    try:
        later = lockrun(
            "--uri", redis_server.uri, *LEASE, "-n", name, "-w", "forever",
            "--", "sh", "-c", "echo $LOCKRUN_FENCE",
        )  # fmt: skip
        assert later.returncode == 0, later.stderr
        assert int(later.stdout) > victim.fence
    finally:
        process.send_signal(signal.SIGCONT)
    status = process.wait(timeout=KILL_AFTER + SLACK + 10)
    _, err = process.communicate(timeout=10)
    assert victim.term_file.exists(), "the command was not sent TERM"
    assert gone(victim.pid)
    check_lost(status, err, name)
