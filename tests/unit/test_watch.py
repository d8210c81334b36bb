"""The supervisor (lockrun.supervise) in this process: a fake lease, a real short command.

The lease is a fake whose refreshes the test scripts, since what `supervise` makes of them
is the subject; the command is `sh`, spawned by `supervise` itself. Each refresh that
should fail waits for the command to say it is ready, so that no outcome depends on how
fast this machine is: the tests assert outcomes (the status, TERM reaching the command,
what is raised), never durations. docs/semantics.md G2, G3 and G7 are the contract.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

import pytest

import lockrun.supervise as supervise_module
from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    LeaseLost,
    TakenOver,
    TimedOut,
)
from lockrun.supervise import FORWARDED, Killed, Limits, _Watch, supervise
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

    from lockrun.guardian import Guardian

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
# TERM writes "term" and ends the command; it says it is ready once the trap is set.
TRAPPED = 'trap \'echo term > "$1"/term; exit 0\' TERM; echo $$ > "$1"/ready; sleep 30 & wait'


def sh(script: str, *args: str) -> list[str]:
    """Return the command line of *script* run by sh, with *args* as $1 …."""
    return ["sh", "-c", script, "sh", *args]


class Lease:
    """A lease whose refresh runs *refresh* (a test's script); never released here."""

    slot, fence, fds, sessions, bells, orphan = 0, None, (), (), (), None

    def __init__(self, refresh: Callable[[], None], ttl: float | None = 30.0) -> None:
        self._refresh = refresh
        self.ttl = ttl
        self.confirmed = now()
        self.refreshes = 0

    def refresh(self) -> None:
        self.refreshes += 1
        self._refresh()

    def release(self, hold: float = 0.0) -> bool:  # noqa: ARG002 - the protocol's
        return True


def fine() -> None:
    """Answer: the lease is ours."""


def once_ready(folder: Path, error: Exception) -> Callable[[], None]:
    """Return a refresh that answers until the command is ready, then raises *error*."""

    def refresh() -> None:
        if (folder / "ready").exists():
            raise error

    return refresh


@contextlib.contextmanager
def nudged() -> Iterator[None]:
    """Send this thread SIGCHLD now and then while the block runs.

    supervise() blocks the signals it waits for in the calling thread only: a thread left
    by another test in this process (the API's renewer lives on) may take the command's
    SIGCHLD, and the kernel drops it there. A spurious SIGCHLD is harmless to supervise (it
    reaps with WNOHANG, as for any other child's); a lost one would stall the test.
    """
    main = threading.get_ident()
    done = threading.Event()

    def nudge() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while not done.wait(0.05):
            signal.pthread_kill(main, signal.SIGCHLD)

    with ThreadPoolExecutor(max_workers=1) as pool:
        nudging = pool.submit(nudge)
        try:
            yield
        finally:
            done.set()
            nudging.result(timeout=30)


def watched(
    argv: Sequence[str],
    lease: Lease,
    limits: Limits | None = None,
    *,
    forward: frozenset[int] = FORWARDED,
    log: Callable[[str], None] = lambda _line: None,
    program: str | None = None,
) -> int:
    """Run *argv* under *lease* as lockrun would, and return its status."""
    limits = limits or Limits(0.05, kill_after=30.0)
    with nudged():
        return supervise(argv, lease, limits, env=ENV, forward=forward, log=log, program=program)


def gone(pid: int) -> bool:
    """Whether *pid* was reaped (by supervise: it is no child of ours any more)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.fixture(autouse=True)
def signals_as_found() -> Iterator[None]:
    """Check that supervise leaves this thread's signal mask as it found it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before


# -- the command's status -------------------------------------------------------------------


def test_the_commands_exit_status_is_returned() -> None:
    """`exit 3` under a lease that stays ours: 3, a plain int."""
    status = watched(["sh", "-c", "exit 3"], Lease(fine))
    assert status == 3
    assert not isinstance(status, Killed)


def test_a_command_killed_by_a_signal_is_128_plus_n_and_told_apart() -> None:
    """KILL: 137, marked `Killed`, unlike a command that exits 137 itself."""
    status = watched(["sh", "-c", "kill -9 $$"], Lease(fine))
    assert status == 137
    assert isinstance(status, Killed)
    status = watched(["sh", "-c", "exit 137"], Lease(fine))
    assert status == 137
    assert not isinstance(status, Killed)


def test_the_command_gets_the_environment_given(tmp_path: Path) -> None:
    """`env` is the command's whole environment."""
    env_file = tmp_path / "env"
    lease = Lease(fine)
    with nudged():
        supervise(
            sh('echo "$LOCKRUN_UNIT" > "$1"', str(env_file)),
            lease,
            Limits(0.05),
            env={**ENV, "LOCKRUN_UNIT": "given"},
        )
    assert env_file.read_text() == "given\n"


def test_the_command_starts_with_no_signal_blocked(tmp_path: Path) -> None:
    """Our blocked signals are ours: the command's mask is empty (docs/design.md A9)."""
    status = tmp_path / "status"
    watched(sh('grep SigBlk /proc/self/status > "$1"', str(status)), Lease(fine))
    assert int(status.read_text().split()[1], 16) == 0


def test_a_command_that_does_not_exist_is_127() -> None:
    """Not found: `CommandNotFound`, and nothing was left running."""
    with pytest.raises(CommandNotFound, match="no-such-command-lockrun: command not found"):
        watched(["no-such-command-lockrun"], Lease(fine))


def test_an_empty_command_name_is_not_found() -> None:
    """An empty name is no command, as a shell says, not a ValueError from posix_spawnp."""
    with pytest.raises(CommandNotFound, match="the command name is empty"):
        watched([""], Lease(fine))


def test_a_file_that_cannot_be_executed_is_126(tmp_path: Path) -> None:
    """A file without the execute bit: `CommandNotExecutable`."""
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    with pytest.raises(CommandNotExecutable, match="cannot execute"):
        watched([str(script)], Lease(fine))


def test_a_local_lock_is_never_lost_by_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ttl (a lock of file:): refreshes that fail are doubts, never a loss; its status stands."""
    monkeypatch.setattr("lockrun.lease_clock.RETRY", 0.05)  # doubts asked again sooner
    refused = BackendUnavailable("the lock file is unreadable")

    def refresh() -> None:
        if lease.refreshes >= 3:
            (tmp_path / "go").touch()
        raise refused

    lease = Lease(refresh, ttl=None)
    lines: list[str] = []
    wait_for_go = 'while [ ! -e "$1"/go ]; do sleep 0.01; done; exit 4'
    assert watched(sh(wait_for_go, str(tmp_path)), lease, log=lines.append) == 4
    assert lease.refreshes >= 3
    assert lines[0] == "lease not confirmed (the lock file is unreadable); retrying"


# -- the lease ------------------------------------------------------------------------------


def test_a_lost_lease_terms_the_command_and_raises_lease_lost(tmp_path: Path) -> None:
    """The service says the lease is gone: TERM to the command, reaped, then `LeaseLost`."""
    lost = LeaseLost("the key is gone")
    lease = Lease(once_ready(tmp_path, lost))
    with pytest.raises(LeaseLost) as raised:
        watched(sh(TRAPPED, str(tmp_path)), lease, Limits(0.05, lost_kill_after=30.0))
    assert raised.value is lost
    assert (tmp_path / "term").read_text() == "term\n"
    assert gone(int((tmp_path / "ready").read_text()))


def test_a_take_over_terms_the_command_and_raises_taken_over(tmp_path: Path) -> None:
    """Another acquirer asked for a take-over: TERM, then `TakenOver` (79)."""
    asked = TakenOver("taken over by alice")
    lease = Lease(once_ready(tmp_path, asked))
    with pytest.raises(TakenOver) as raised:
        watched(sh(TRAPPED, str(tmp_path)), lease)
    assert raised.value is asked
    assert (tmp_path / "term").read_text() == "term\n"


def test_max_time_stops_the_command_and_raises_timed_out() -> None:
    """--max-time: the command is stopped, then `TimedOut` (124) naming the limit."""
    with pytest.raises(TimedOut, match=r"^--max-time 0\.20s expired; stopped the command$"):
        watched(["sleep", "30"], Lease(fine), Limits(10.0, max_time=0.2, kill_after=30.0))


def test_a_command_that_ignores_term_is_killed_after_the_grace() -> None:
    """TERM ignored: KILL once --kill-after is up (else this never returns); `TimedOut`."""
    script = "trap '' TERM; while :; do sleep 1; done"
    with pytest.raises(TimedOut):
        watched(sh(script), Lease(fine), Limits(10.0, max_time=0.1, kill_after=0.1))


def test_an_unavailable_refresh_is_a_doubt_and_a_good_one_keeps_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One refresh fails, the next proves the lease: logged, and the command's status stands."""
    monkeypatch.setattr("lockrun.lease_clock.RETRY", 0.05)  # the doubt is asked again sooner
    ready, failed, go = (tmp_path / part for part in ("ready", "failed", "go"))
    refused = BackendUnavailable("connection refused")

    def refresh() -> None:
        if not ready.exists():  # before the spawn, or while sh starts: the lease is ours
            return
        if not failed.exists():
            failed.touch()
            raise refused
        go.touch()  # proved again: the command may end now

    lines: list[str] = []
    wait_for_go = 'touch "$1"/ready; while [ ! -e "$1"/go ]; do sleep 0.01; done; exit 5'
    status = watched(sh(wait_for_go, str(tmp_path)), Lease(refresh), log=lines.append)
    assert status == 5
    assert lines[0] == "lease not confirmed (connection refused); retrying"


def test_a_lease_unconfirmed_until_its_deadline_stops_the_command(tmp_path: Path) -> None:
    """Every refresh unavailable: the command is stopped before the lease could run out."""
    lease = Lease(once_ready(tmp_path, BackendUnavailable("connection refused")), ttl=3.0)
    with pytest.raises(LeaseLost, match=r"^lease could not be confirmed: connection refused$"):
        watched(sh(TRAPPED, str(tmp_path)), lease, Limits(1.0, kill_after=30.0))
    assert gone(int((tmp_path / "ready").read_text()))


def test_a_bug_in_a_refresh_stops_the_command_and_is_raised(tmp_path: Path) -> None:
    """Not a lockrun error: the command is stopped and reaped, then the bug goes up (70)."""
    bug = RuntimeError("a bug in the backend")
    with pytest.raises(RuntimeError) as raised:
        watched(sh(TRAPPED, str(tmp_path)), Lease(once_ready(tmp_path, bug)))
    assert raised.value is bug
    assert (tmp_path / "term").read_text() == "term\n"
    assert gone(int((tmp_path / "ready").read_text()))


def test_a_stale_lease_is_renewed_before_the_command_starts() -> None:
    """Due for renewal by the spawn: renewed first; the command then runs."""
    lease = Lease(fine)
    lease.confirmed = now() - 10.0
    assert watched(["sh", "-c", "exit 0"], lease, Limits(1.0)) == 0
    assert lease.refreshes >= 1


@pytest.mark.parametrize("error", [LeaseLost("gone"), BackendUnavailable("refused")])
def test_a_stale_lease_that_cannot_be_renewed_runs_nothing(
    tmp_path: Path, error: Exception
) -> None:
    """Lost (76) or unreachable (69) before the spawn: raised as such, and nothing ran."""
    lease = Lease(once_ready(tmp_path, error))
    (tmp_path / "ready").touch()
    lease.confirmed = now() - 10.0
    with pytest.raises(type(error), match=r"before the command started: .*; nothing ran"):
        watched(sh('touch "$1"/ran', str(tmp_path)), lease, Limits(1.0))
    assert not (tmp_path / "ran").exists()


# -- signals --------------------------------------------------------------------------------


def test_a_forwarded_signal_reaches_the_command(tmp_path: Path) -> None:
    """USR1 to lockrun is the command's: its trap ends it with 9."""
    script = "trap 'exit 9' USR1; echo $$ > \"$1\"/ready; sleep 30 & wait"
    me = threading.get_ident()

    def refresh() -> None:
        if (tmp_path / "ready").exists() and not (tmp_path / "sent").exists():
            (tmp_path / "sent").touch()
            signal.pthread_kill(me, signal.SIGUSR1)  # as a kill would, to the waiting thread

    assert watched(sh(script, str(tmp_path)), Lease(refresh)) == 9


def test_a_signal_not_forwarded_is_dropped(tmp_path: Path) -> None:
    """USR1 left out of *forward*: the command never hears it and ends on its own, 0."""
    script = (
        "trap 'exit 9' USR1; echo $$ > \"$1\"/ready; "
        'while [ ! -e "$1"/go ]; do sleep 0.01; done; exit 0'
    )

    me = threading.get_ident()

    def refresh() -> None:
        if (tmp_path / "sent").exists():
            (tmp_path / "go").touch()
        elif (tmp_path / "ready").exists():
            (tmp_path / "sent").touch()
            signal.pthread_kill(me, signal.SIGUSR1)

    forward = FORWARDED - {signal.SIGUSR1}
    status = watched(sh(script, str(tmp_path)), Lease(refresh), forward=forward)
    assert status == 0


# -- the watch's arithmetic, without a command ----------------------------------------------


class FakeGuardian:
    """The part of a guardian the watch tells its deadlines to."""

    pid = 4242

    def __init__(self) -> None:
        self.expected: list[tuple[float, float, float]] = []

    def expect(self, term_at: float, deadline: float, late: float) -> None:
        self.expected.append((term_at, deadline, late))


def test_the_guardian_is_told_to_act_between_our_last_term_and_the_deadline() -> None:
    """Confirmed at c, ttl 30, --kill-after 10: our last TERM c+17, deadline c+27; it, c+22."""
    lease = Lease(fine)
    guardian = FakeGuardian()
    limits = Limits(10.0, kill_after=10.0, lost_kill_after=1.0)
    watch = _Watch(lease, limits, FORWARDED, print, cast("Guardian", guardian))
    assert watch.group == FakeGuardian.pid
    watch.confirm_before_start()
    c = lease.confirmed
    assert len(guardian.expected) == 1
    term_at, deadline, late = guardian.expected[0]
    assert term_at == pytest.approx(c + 22.0)
    assert deadline == pytest.approx(c + 27.0)
    assert late == 1.0
    assert lease.refreshes == 0


def test_a_local_lock_tells_the_guardian_nothing() -> None:
    """No ttl, no deadline: nothing for the guardian to enforce."""
    guardian = FakeGuardian()
    watch = _Watch(
        Lease(fine, ttl=None), Limits(10.0), FORWARDED, print, cast("Guardian", guardian)
    )
    watch.confirm_before_start()
    assert guardian.expected == []
    assert watch.clock.deadline() == math.inf


def test_the_watch_renews_at_the_limits_cadence_from_the_grant() -> None:
    """The first renewal is due *refresh_every* after the grant's request, not after now."""
    lease = Lease(fine)
    lease.confirmed = 100.0
    watch = _Watch(lease, Limits(7.0), FORWARDED, print, None)
    assert watch.clock.refresh_due() == 107.0
    assert watch.group == 0  # the command's own group, made at the spawn
    assert watch.failure is None


def test_a_stop_keeps_the_first_failure() -> None:
    """Lost after timed out: the outcome is the first reason the command was stopped."""
    watch = _Watch(Lease(fine), Limits(10.0, kill_after=3600.0), FORWARDED, print, None)
    watch.group = 2**30  # no such group (over pid_max): the TERM goes nowhere
    first, second = TimedOut("late"), LeaseLost("gone")
    watch._begin_stop(first)
    kill_at = watch.kill_at
    watch._begin_stop(second, kill_by=now())  # would KILL at once, were it the first
    assert watch.failure is first
    assert kill_at is not None
    assert watch.kill_at == kill_at


def test_a_stop_kills_by_the_earlier_of_the_grace_and_the_deadline_given() -> None:
    """KILL after --kill-after, or at *kill_by* if that is sooner: the lease may be ending."""
    watch = _Watch(Lease(fine), Limits(10.0, kill_after=3600.0), FORWARDED, print, None)
    watch.group = 2**30
    kill_by = now() + 600.0
    watch._begin_stop(LeaseLost("gone"), kill_by=kill_by)
    assert watch.kill_at == kill_by


# -- the hand-over's path: the command first, then the watchers ------------------------------


class Belled(Lease):
    """A lease whose bells, when asked for, note it in *events* (or fail with *error*)."""

    def __init__(self, events: list[str], error: Exception | None = None) -> None:
        super().__init__(fine)
        self.events = events
        self.error = error

    @property
    def bells(self) -> tuple[int, ...]:  # type: ignore[override]
        self.events.append("bells")
        if self.error is not None:
            raise self.error
        return ()


def spawns_noted(monkeypatch: pytest.MonkeyPatch, events: list[str], pids: list[int]) -> None:
    """Note each spawn of `supervise` in *events*, and its pid in *pids*."""
    spawn = supervise_module._spawn

    def noted(*args: object, **kwargs: object) -> int:
        pid = spawn(*args, **kwargs)  # type: ignore[arg-type]
        events.append("spawn")
        pids.append(pid)
        return pid

    monkeypatch.setattr(supervise_module, "_spawn", noted)


def test_the_command_is_spawned_before_the_lease_is_asked_for_its_bells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease's bells (a round trip and a thread on Redis) are armed once the command runs."""
    events: list[str] = []
    spawns_noted(monkeypatch, events, [])
    assert watched(["true"], Belled(events)) == 0
    assert events == ["spawn", "bells"]


def test_a_watcher_that_fails_after_the_spawn_stops_and_reaps_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Nothing runs unwatched: the failure is raised once the command is stopped and reaped."""
    events: list[str] = []
    pids: list[int] = []
    spawns_noted(monkeypatch, events, pids)
    with pytest.raises(RuntimeError, match="no bells"):
        watched(sh(TRAPPED, str(tmp_path)), Belled(events, RuntimeError("no bells")))
    assert events == ["spawn", "bells"]
    assert gone(pids[0])


class Late(Lease):
    """A lease whose bells are asked for only once its command has exited (not reaped)."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(fine)
        self.pids = pids

    @property
    def bells(self) -> tuple[int, ...]:  # type: ignore[override]
        os.waitid(os.P_PID, self.pids[0], os.WEXITED | os.WNOWAIT)  # exited, still a zombie
        return ()


def test_a_sigchld_another_thread_took_does_not_leave_the_command_unreaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGCHLD another thread took while lockrun armed its watchers: still reaped.

    The command ends while lockrun arms its watchers, and a thread of the process that does
    not block SIGCHLD (a library's, the API's renewals thread) takes the signal: the loop
    still reaps the command and returns its status, not waiting for a signal gone.
    """
    pids: list[int] = []
    spawns_noted(monkeypatch, [], pids)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # SIGCHLD not blocked in it
    other.start()
    try:  # not `watched`: its nudges would stand in for the lost signal
        assert supervise(["true"], Late(pids), Limits(0.05, kill_after=30.0), env=ENV) == 0
    finally:
        stop.set()
        other.join()


def test_find_program_finds_what_a_path_search_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first executable regular file of that name in PATH; None where the spawn must search."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "tool").write_text("#!/bin/sh\n")  # not executable: passed over, as execvp does
    (first / "dir-named-tool").mkdir()
    (second / "tool").write_text("#!/bin/sh\nexit 3\n")
    (second / "tool").chmod(0o755)
    monkeypatch.setenv("PATH", f"{first}:{second}")
    assert supervise_module.find_program("tool") == str(second / "tool")
    assert supervise_module.find_program("dir-named-tool") is None
    assert supervise_module.find_program("missing") is None
    assert supervise_module.find_program("./tool") is None  # a slash: no search at all
    assert supervise_module.find_program("") is None
    monkeypatch.setenv("PATH", f"{first}::{second}")  # an empty entry: the working directory
    assert supervise_module.find_program("tool") is None
    monkeypatch.setenv("PATH", f"relative:{second}")
    assert supervise_module.find_program("tool") is None


def test_a_program_found_before_the_wait_and_moved_since_is_searched_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup before the wait only saves the spawn's search: a file moved is found again.

    One that stopped being executable is 126, as without the lookup.
    """
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    ran = tmp_path / "ran"
    (first / "tool").write_text(f"#!/bin/sh\n: > {ran}\n")
    (first / "tool").chmod(0o755)
    monkeypatch.setenv("PATH", f"{first}:{second}")
    found = supervise_module.find_program("tool")
    assert found == str(first / "tool")
    (first / "tool").rename(second / "tool")  # a deploy moved it while we waited
    with nudged():
        assert supervise(["tool"], Lease(fine), Limits(0.05), env=ENV, program=found) == 0
    assert ran.exists()
    (second / "tool").rename(first / "tool")
    (first / "tool").chmod(0o644)
    with pytest.raises(CommandNotExecutable, match="tool: cannot execute"):
        watched(["tool"], Lease(fine), program=found)
