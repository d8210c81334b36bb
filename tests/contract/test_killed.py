"""Every lockrun process of a run killed, in any order: the command never outlives the lock.

docs/semantics.md G2 and "A killed holder". `killall -9 lockrun` or
`pkill -9 -f 'lockrun .*nightly'` kills lockrun and its guardian together (the guardian is a
fork with the same name and command line), and neither can then stop the command. The
kernel does: the command holds the read end of a pipe that only they can write, armed to
SIGKILL the command's group when the last writer goes. Each test kills real processes with
real signals and judges by the commands' own logs (tests/support/harness.py `COMMAND`,
stamped by the kernel's clock), never by lockrun's word: the next holder's command must
start after the first one's last sign of life.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.support.cli import finish, wait_for
from tests.support.cli import lockrun as run_lockrun
from tests.support.harness import CALM, Harness, Run, command, read_run, wait_for_death

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# A hang guard only: how long a dead group may take to be seen dead on a loaded machine.
DEATH: Final = 30.0
CALM_TTL: Final = float(CALM[1])
LAPSE: Final = ("--ttl", "4")  # renewed every 1.3 s while lockrun lives
MARK: Final = "--kill-after=9"  # the holder's alone: the pattern an operator would write
ORDERS: Final = ("at-once-by-name", "guardian-then-lockrun", "lockrun-then-guardian")


def _alone_after(first_log: Path, second_log: Path) -> tuple[Run, Run]:
    """Assert the second command ran alone and began after the first's last sign of life.

    Return both runs, as the commands logged them (kernel-stamped: never lockrun's word).
    """
    first, second = read_run(first_log), read_run(second_log)
    assert second.verdict == "alone"
    assert second.begun > first.last  # [begun, last] intervals do not overlap
    return first, second


def _group(pid: int) -> int:
    """Return the process group of *pid* (/proc/PID/stat, field 5)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[2])


def _kill(order: str, name: str, lockrun: int, guardian: int) -> None:
    """SIGKILL lockrun and its guardian in *order*; return once both are gone."""
    if order == "at-once-by-name":  # as an operator would: both match the pattern
        subprocess.run(["pkill", "-9", "-f", f"lockrun --uri .* -n {name} {MARK}"], check=True)
        return
    first, second = (guardian, lockrun) if order == "guardian-then-lockrun" else (lockrun, guardian)
    os.kill(first, signal.SIGKILL)
    os.kill(second, signal.SIGKILL)


@pytest.mark.parametrize("order", ORDERS)
def test_killing_lockrun_and_its_guardian_takes_the_command_along(
    shared_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any], order: str
) -> None:
    """Whatever order lockrun and its guardian die in, the next command starts after ours.

    The command runs one shell below lockrun, so the kill must take the group, not a pid.
    `file:` runs with --close here: without it the command holds the lock itself, and no
    guardian exists to kill (tests/backends/test_file.py covers that case).
    """
    harness = shared_harness
    close = ("--close",) if harness.kind.inherits_fds else ()
    options = ("--uri", harness.uri, "-n", name, *close)
    first_argv, first_log, first_go = command(tmp_path, "first")
    below = ["sh", "-c", '"$@" & wait', "sh", *first_argv]  # the command is a grandchild
    holder = spawn(
        "--uri",
        harness.uri,
        "-n",
        name,
        MARK,
        *close,
        *LAPSE,  # when both die, nobody releases the lease: the waiter waits it out
        "--",
        *below,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: first_log.exists() or holder.poll() is not None, what="the first command")
        first_pid = read_run(first_log).pid
        guardian = _group(first_pid)
        assert guardian != first_pid, "the command runs in its guardian's group"
        second_argv, second_log, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        waiter = spawn(*options, *CALM, "-w", "forever", "--", *second_argv)
        if not harness.kind.local:  # a local waiter that queues late proves the same
            wait_for(lambda: harness.waits(name, waiter.pid), what="the waiter to queue")
        pidfd = os.pidfd_open(first_pid)
        try:
            _kill(order, name, holder.pid, guardian)
            died = wait_for_death(pidfd, time.time() + DEATH)
        finally:
            os.close(pidfd)
        assert died is not None, f"{order}: the command outlived every lockrun process"
        assert finish(waiter, timeout=CALM_TTL + DEATH) == 0
    finally:
        first_go.touch()  # whatever failed, no loop is left running
    first, second = _alone_after(first_log, second_log)
    assert second.fence > first.fence


def test_a_killed_holders_lease_is_freed_by_its_guardian_before_it_runs_out(
    shared_server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A holder SIGKILLed alone: its guardian kills the group, then frees a lease at once.

    On Redis the lease stayed taken for the rest of its ttl (30 s here); the next holder
    now starts before the server's own expiry of the dead holder's lease, and after the
    first command's last sign of life. Sessions end with the guardian, as before.
    """
    harness = shared_server_harness
    ttl = 30.0
    options = ("--uri", harness.uri, "-n", name)
    first_argv, first_log, first_go = command(tmp_path, "first")
    holder = spawn(*options, "--ttl", f"{ttl:g}", "--", *first_argv, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: first_log.exists() or holder.poll() is not None, what="the first command")
        second_argv, second_log, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        waiter = spawn(*options, *CALM, "-w", "forever", "--", *second_argv)
        wait_for(lambda: harness.waits(name, waiter.pid), what="the waiter to queue")
        expires = harness.expiry(name, ttl)  # a lease ends no earlier than this
        holder.send_signal(signal.SIGKILL)
        assert finish(waiter, timeout=ttl + DEATH) == 0
    finally:
        first_go.touch()
    _, second = _alone_after(first_log, second_log)
    if expires is not None:  # a lease: freed by the guardian, not by its running out
        assert second.begun < expires


def test_a_holder_killed_as_its_release_is_on_the_way_is_freed_by_its_guardian(
    server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """Killed once its command ended, its release lost on the way: the guardian frees it.

    A release that leaves no --hold-at-least window has nothing its guardian's own free
    could cut, so the guardian is not told of it (issue #33: the message woke the guardian
    beside the release, 0.3 ms of etcd's hand-over); were lockrun to die meanwhile, the
    guardian frees the lease at once. Told, it left the lease to run out (30 s here).
    """
    harness = server_harness
    if not harness.kind.leased or harness.proxy is None:
        pytest.skip(f"{harness.backend}: a session's lock ends with its connection")
    ttl = 30.0
    go = tmp_path / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.01; done"
    holder = spawn(
        "--uri", harness.proxied, "-n", name, "-v", "--ttl", f"{ttl:g}", "--", "sh", "-c", wait
    )
    assert holder.stderr is not None
    acquired = holder.stderr.readline()  # -v: once the run holds the lock, all set up
    assert acquired.startswith(f"lockrun: acquired {name} "), acquired
    (guardian,) = [pid for pid in _children(holder.pid) if _group(pid) == pid]
    expires = harness.expiry(name, ttl)
    assert expires is not None
    harness.partition()  # the release goes nowhere
    go.touch()
    wait_for(lambda: len(_children(holder.pid)) == 1, what="the command's end")
    os.kill(guardian, signal.SIGSTOP)  # it hears of lockrun's death only once we let it
    holder.kill()
    holder.wait(timeout=30)
    harness.proxy.reset()  # what lockrun sent dies with its connections
    harness.proxy.heal()
    os.kill(guardian, signal.SIGCONT)
    free = run_lockrun(
        "--uri", harness.uri, "-n", name, "-w", "forever", "--", "true", timeout=ttl + DEATH
    )
    assert free.returncode == 0, free.stderr
    assert time.time() < expires, "the lease ran out: its guardian never freed it"


def test_what_the_command_leaves_in_its_group_never_runs_beside_the_next_holder(
    shared_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A command that ends leaving a child behind: the child never overlaps the next holder.

    With a guardian the child is stopped before the release, and the lock passes on only
    then; `file:` keeps the lock in the child's inherited descriptor until it ends (busy
    meanwhile), as flock(1) does. It ran on beside the next holder on the server backends.
    """
    harness = shared_harness
    _leave_a_child(harness, ("--uri", harness.uri, "-n", name), tmp_path, spawn)


def test_a_release_that_never_reached_the_server_is_not_called_released(
    server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """The command ends during a partition: -v says the release was not heard, and why.

    It said "released NAME after Xs" although the server still held the lock.
    """
    harness = server_harness
    assert harness.proxied is not None
    go = tmp_path / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done"
    holder = spawn("--uri", harness.proxied, "-n", name, "-v", *CALM, "--", "sh", "-c", wait)
    assert holder.stderr is not None
    acquired = holder.stderr.readline()  # -v: once the run holds the lock, all set up
    assert acquired.startswith(f"lockrun: acquired {name} "), acquired
    harness.partition()
    go.touch()
    _, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert f"released {name} after" not in err
    assert f"could not tell the server to release {name}" in err


def test_a_leftover_that_closed_its_descriptors_never_runs_beside_the_next_holder(
    shared_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A leftover child that closed every descriptor (closefrom) is stopped all the same.

    closefrom(2) is what many daemons and set-uid programs do at start. Such a child holds
    no end of the switch, which lockrun asked first: the lock passed on while it ran.
    `file:` runs with --close: without it a child that closed the lock's descriptor gave
    the lock up (docs/semantics.md "Forking children and daemons").
    """
    harness = shared_harness
    close = ("--close",) if harness.kind.inherits_fds else ()
    closefrom = (
        "import os, sys; os.closerange(3, os.sysconf('SC_OPEN_MAX')); "
        "os.execvp(sys.argv[1], sys.argv[1:])"
    )
    below = (sys.executable, "-c", closefrom)
    _leave_a_child(harness, ("--uri", harness.uri, "-n", name, *close), tmp_path, spawn, below)


def _leave_a_child(
    harness: Harness,
    options: tuple[str, ...],
    tmp_path: Path,
    spawn: Callable[..., Any],
    below: tuple[str, ...] = (),
) -> None:
    """Run a command that ends at once, leaving a `COMMAND` child (run by *below*) behind.

    Then a second holder runs; the child must never have run beside it. Where the command
    holds the lock itself (`file:` without --close) the child keeps it, busy, until it ends.
    """
    first_argv, first_log, first_go = command(tmp_path, "first")
    leave = f'"$@" & while [ ! -e {first_log} ]; do sleep 0.05; done; exit 0'
    try:
        # stderr not piped: the child left behind would hold the pipe open.
        holder = spawn(
            *options, *CALM, "--", "sh", "-c", leave, "sh", *below, *first_argv,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert holder.wait(60) == 0
        if harness.kind.inherits_fds and "--close" not in options:  # the child holds it
            assert finish(spawn(*options, "-w", "0", "--", "true")) == 75
            first_go.touch()
        second_argv, second_log, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        assert finish(spawn(*options, *CALM, "-w", "forever", "--", *second_argv), 60) == 0
    finally:
        first_go.touch()
    _alone_after(first_log, second_log)


def _children(pid: int) -> list[int]:
    """Return the children of process *pid*."""
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return list(map(int, children.read().split()))


def _sockets(pid: int) -> set[str]:
    """Return the sockets process *pid* holds, as /proc/PID/fd names them."""
    links = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    return {link for link in links if link.startswith("socket:")}


def test_a_waiters_guardian_holds_none_of_its_connections(
    shared_server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """A queued waiter's guardian holds no socket of lockrun's: only its end of their pair.

    A connection it inherited at the fork would outlive a SIGKILLed waiter, and the server
    would hand the slot to the dead (why a run forks its guardian before it connects).
    """
    harness = shared_server_harness
    options = ("--uri", harness.uri, "-n", name)
    first_argv, first_log, first_go = command(tmp_path, "first")
    holder = spawn(*options, "--", *first_argv, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: first_log.exists() or holder.poll() is not None, what="the first command")
        second_argv, _, second_go = command(tmp_path, "second", other=first_log)
        second_go.touch()
        waiter = spawn(*options, *CALM, "-w", "forever", "--", *second_argv)
        wait_for(lambda: harness.waits(name, waiter.pid), what="the waiter to queue")
        # etcd's is forked as the waiter begins to wait, after it queued, and first drops
        # the connections it inherited (docs/design.md A11): wait for that, not for ever.
        wait_for(lambda: _children(waiter.pid), what="the waiter's guardian")
        (guardian,) = _children(waiter.pid)
        wait_for(lambda: len(_sockets(guardian)) == 1, what="the guardian's one socket")
        ours, its = _sockets(waiter.pid), _sockets(guardian)
        assert len(its) == 1, its  # its end of the pair lockrun speaks to it on
        assert not ours & its, f"the guardian holds lockrun's {ours & its}"
        assert len(ours) >= 2, ours  # the pair's other end, and a connection at least
    finally:
        first_go.touch()
    assert finish(waiter, timeout=DEATH) == 0
