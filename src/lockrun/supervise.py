"""Run the command while the lock is held: spawn, forward signals, keep the lease, reap.

No Python signal handlers: the signals we care about are blocked and taken one at a time
from `sigtimedwait`, whose timeout doubles as the lease-refresh and --max-time timer
(docs/design.md A9). Lease refreshes run in a short-lived thread each, so a backend that
hangs cannot hold up a stop the lease needs. A session lock (MySQL, PostgreSQL) is also
watched for the server hanging up, which frees it at once, between two refreshes.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import stat
import threading
import time
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    LeaseLost,
    LockrunError,
    TakenOver,
    TimedOut,
)
from lockrun.lease_clock import Answer, LeaseClock, Verdict
from lockrun.processes import kill_the_others, members
from lockrun.sigmask import pthread_sigmask
from lockrun.timing import format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from lockrun.backends import Lease
    from lockrun.guardian import Guardian

FORWARDED: Final = frozenset(
    {
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
    }
)
# Raised by `_Hangups` when the server hangs up on a session lock; ignored by default.
_HANGUP: Final = signal.SIGURG
# Raised by `_Hangups` when a take-over bell rings (`Lease.bells`): refresh now.
_BELL: Final = signal.SIGIO
_WATCHED: Final = FORWARDED | {signal.SIGCHLD, _HANGUP, _BELL}
# SIGTTOU: taking the terminal back from the command's group while we are in the background.
_BLOCKED: Final = _WATCHED | {signal.SIGTTOU}
# CPython ignores these and exec(2) would pass that on (docs/design.md A9).
_DEFAULTED: Final = (signal.SIGPIPE, signal.SIGXFSZ)

# How often the loop looks for the command's end itself, where a thread that does not block
# SIGCHLD may have taken the signal (`_Watch.run`).
REAP_EVERY: Final = 1.0
_POLL: Final = 0.02  # how often the loop looks at a refresh under way (normally ~1 ms)
# How long a local lock's command runs before its take-over bells are made. file:'s bell is
# an inotify watch: ctypes to load, and a close that waits in the kernel for milliseconds
# (an SRCU grace period), for every run. A run shorter than this makes none; a taker waits
# at most this much longer, since a refresh as the bell is made finds a request made before
# (docs/semantics.md "Take-over", issue #32). A server's bell is made at once, where a
# refresh is a round trip.
LOCAL_BELL_AFTER: Final = 0.1


class Killed(int):
    """The status 128+N of a command that a signal N ended, told apart from an exit(128+N)."""

    __slots__ = ()


class Limits(NamedTuple):
    """How the command is watched: lease cadence, wall-clock limit, graces before KILL.

    *lost_kill_after* is the grace once the lock is known to be gone (the server said so,
    or ended the session): someone else may hold it already, so it is short.
    """

    refresh_every: float
    max_time: float | None = None
    kill_after: float = 10.0
    lost_kill_after: float = 1.0

    # b"d": the deadlines came earlier; b"f": descriptors to keep (taken above)


def supervise(
    argv: Sequence[str],
    lease: Lease,
    limits: Limits,
    *,
    env: Mapping[str, str],
    pass_fds: Sequence[int] = (),
    guardian: Guardian | None = None,
    forward: frozenset[int] = FORWARDED,
    log: Callable[[str], None] = lambda _line: None,
    program: str | None = None,
    ended: Callable[[], object] = lambda: None,
) -> int:
    """Run *argv* while *lease* is held and return its exit status (128+N if signalled).

    *program*: the file `find_program` found for ``argv[0]`` before the wait, if any.
    *ended* is called once the command's group is done, before the watchers are taken
    down (a thread joined, descriptors closed): the caller's release, first on the
    hand-over's path (issue #33). Not when the command was stopped: the caller releases.

    The command runs in its own process group, or in *guardian*'s; the signals of
    *forward* that lockrun receives are sent on to that group. Raises `LeaseLost` or
    `TimedOut` after the command was stopped, and `CommandNotFound`/`CommandNotExecutable`
    if it could not start. Whatever happens, the command has been reaped before this
    returns or raises.
    """
    saved = pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    try:
        watch = _Watch(lease, limits, forward, log, guardian)
        hangups = watch.hangups  # its pipe and epoll made before the pre-spawn check
        try:
            watch.confirm_before_start()  # the last thing before the spawn
            if guardian is not None:
                pass_fds = (*pass_fds, guardian.switch)
            watch.start(_spawn(argv, env, pass_fds, group=watch.group, program=program))
            # The command runs from here: the watchers are armed after its spawn, off the
            # hand-over's path (a lease's bells may cost a round trip and a thread,
            # docs/design.md A9). Nothing is missed meanwhile: a hang-up is level-triggered,
            # and a bell made after a take-over was asked is rung already. Whatever fails
            # now stops the command.
            with watch.stopping_on_error():
                watch.arm_bells()
                with hangups:
                    if guardian is not None:
                        guardian.started()
                    with _terminal_for(watch.group) as terminal:
                        watch.terminal = terminal
                        status = watch.run()
                    ended()
                    return status
        finally:
            hangups.close()
    finally:
        # A bell rung after the loop's last wait stays pending, and SIGIO's default action
        # would end lockrun (status -29) the moment it is unblocked: drop it, and a late
        # hang-up's SIGURG with it (_Hangups has stopped: nothing raises them any more).
        while signal.sigtimedwait({_BELL, _HANGUP}, 0) is not None:
            pass
        pthread_sigmask(signal.SIG_SETMASK, saved)


def find_program(name: str) -> str | None:
    """Return the file posix_spawnp(3) would run for command *name*, looked up now; else None.

    Done before the wait: the lookup tries each PATH directory in turn (0.9 ms with nine of
    them, measured on the hand-over, issue #33), which `_spawn` then skips. None where the
    name has a slash, PATH has a relative or empty entry (the working directory's to
    judge at the spawn), or no directory has an executable file of that name.
    """
    if not name or "/" in name:
        return None
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        if not directory.startswith("/"):
            return None
        candidate = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.stat(candidate).st_mode) and os.access(candidate, os.X_OK):
                return candidate
    return None


def _spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    pass_fds: Sequence[int],
    *,
    group: int,
    program: str | None = None,
) -> int:
    """Start *argv* in process *group* (0: its own) with an empty mask and default SIGPIPE.

    *program*, found before the wait (`find_program`), is run without a PATH search; gone
    meanwhile, the search is made as it would have been.
    """
    if not argv[0]:  # as a shell says of "": posix_spawnp would raise ValueError
        msg = "'': command not found (the command name is empty)"
        raise CommandNotFound(msg)
    for fd in pass_fds:
        os.set_inheritable(fd, True)  # noqa: FBT003 - the os API
    # posix_spawn(3) vforks: no copy of this process on the hand-over path, unlike
    # subprocess with a preexec_fn, which it would need to reset the signal mask.
    try:
        if program is not None:
            with contextlib.suppress(FileNotFoundError):  # gone: search as posix_spawnp does
                return os.posix_spawn(
                    program, list(argv), env, setpgroup=group, setsigmask=(), setsigdef=_DEFAULTED
                )
        return os.posix_spawnp(
            argv[0], list(argv), env, setpgroup=group, setsigmask=(), setsigdef=_DEFAULTED
        )
    except FileNotFoundError as err:
        msg = f"{argv[0]}: command not found"
        raise CommandNotFound(msg) from err
    except OSError as err:
        msg = f"{argv[0]}: cannot execute: {err.strerror}"
        raise CommandNotExecutable(msg) from err


@contextlib.contextmanager
def _terminal_for(group: int) -> Iterator[bool]:
    """Give the terminal's foreground to the command's group while it runs, if it is ours."""
    if not _own_foreground_terminal():
        yield False
        return
    os.tcsetpgrp(0, group)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGCONT)  # in case it read the terminal before it was given it
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(0, os.getpgrp())  # SIGTTOU is blocked, so this works from the background


def _own_foreground_terminal() -> bool:
    """Return whether stdin is a terminal whose foreground group is ours and ours alone."""
    try:
        if not os.isatty(0) or os.tcgetpgrp(0) != os.getpgrp():
            return False
    except OSError:  # a terminal that is not our controlling one
        return False
    # In `lockrun … | less` our group holds `less` too: handing over would stop it.
    return members(os.getpgrp()) == [os.getpid()]


def genuine(info: signal.struct_siginfo) -> bool:
    """Tell a received signal from garbage.

    When a stop and continue (SIGSTOP, a frozen VM) interrupt a wait whose time then runs
    out, CPython 3.11's sigtimedwait returns the uninitialised siginfo of a wait that got
    nothing. A real one carries a watched signal and a kernel si_code (SI_USER, SI_KERNEL,
    SI_QUEUE, SI_TKILL, CLD_*: all within -64 … 128).
    """
    return info.si_signo in _WATCHED and -64 <= info.si_code <= 128  # noqa: PLR2004


_HUNG_UP: Final = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _hangup_poll(fds: Sequence[int]) -> select.poll:
    """Return a poll object that reports the far end closing any of the sockets *fds*."""
    poll = select.poll()
    for fd in fds:
        poll.register(fd, select.POLLRDHUP)
    return poll


def hung_up(fds: Sequence[int]) -> bool:
    """Return whether the far end has closed any of the sockets *fds* (or they are gone)."""
    return any(events & _HUNG_UP for _, events in _hangup_poll(fds).poll(0))


def readable(fds: Sequence[int]) -> bool:
    """Return whether any of *fds* has something to read right now."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class _Hangups:
    """Wake the loop when the server hangs up on a session lock, or a take-over bell rings.

    A session lock ends with its session: the server frees it when it closes the
    connection (KILL, a restart, a reset by the network), and the next waiter gets in at
    once. The refresh every ttl/3 would leave the command running that long without the
    lock. POLLRDHUP fires on the server's FIN or RST alone, not on the answers to our own
    refreshes: it raises `_HANGUP`, once. A bell (`Lease.bells`) turning readable raises
    `_BELL`, which asks for a refresh now; bells are edge-triggered, so one that stays
    readable (waiters in a listening socket's backlog) rings once per new event, not in a
    loop. Started with the signals blocked, so the signals go to the loop. Its thread is
    made only once there is something to watch: after the spawn for a lease whose bells
    come then (issue #33: a thread's making is on the hand-over's path).
    """

    def __init__(self, sessions: Sequence[int], bells: Sequence[int] = ()) -> None:
        self._thread: threading.Thread | None = None
        self._entered = False
        self._watched = bool(sessions)
        self._sessions = set(sessions)
        self._epoll = select.epoll()
        for fd in sessions:
            self._epoll.register(fd, select.EPOLLRDHUP)  # HUP and ERR are always reported
        self._wake, self._waker = os.pipe()
        self._epoll.register(self._wake, select.EPOLLIN)
        self.ring_on(bells)

    def ring_on(self, bells: Sequence[int]) -> None:
        """Watch *bells* too, from now on; one readable already rings once."""
        for fd in bells:
            self._epoll.register(fd, select.EPOLLIN | select.EPOLLET)
            self._watched = True
        self._begin()

    def _begin(self) -> None:
        """Start watching once entered, if there is anything to watch, and not twice."""
        if self._entered and self._watched and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lockrun-hangups", daemon=True)
            self._thread.start()

    def __enter__(self) -> None:
        self._entered = True
        self._begin()

    def __exit__(self, *_: object) -> None:
        os.write(self._waker, b"x")
        if self._thread is not None:
            self._thread.join()
        self.close()

    def close(self) -> None:
        """Close the descriptors (once); the thread must not run."""
        if self._wake >= 0:
            self._epoll.close()
            os.close(self._wake)
            os.close(self._waker)
            self._wake = self._waker = -1

    def _run(self) -> None:
        while True:
            events = dict(self._epoll.poll())
            if self._wake in events:
                return
            if any(fd in self._sessions for fd in events):
                os.kill(os.getpid(), _HANGUP)
                return
            os.kill(os.getpid(), _BELL)


class _Ask(threading.Thread):
    """One lease refresh, run beside the loop so a hanging backend cannot delay a stop."""

    def __init__(self, lease: Lease) -> None:
        super().__init__(name="lockrun-refresh", daemon=True)
        self.lease = lease
        self.sent = now()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.lease.refresh()
        except BaseException as err:  # noqa: BLE001 - handed to the loop, which decides
            self.error = err


class _Watch:
    """The supervision loop's state: timers, the stop sequence, and the outcome.

    The lease is counted from when the request that last proved it was sent
    (`Lease.confirmed`), not from when an answer came or the command started: a stall
    anywhere after the grant comes out of the lease's time, never on top of it.
    """

    def __init__(
        self,
        lease: Lease,
        limits: Limits,
        forward: frozenset[int],
        log: Callable[[str], None],
        guardian: Guardian | None,
    ) -> None:
        self.pid = 0  # the command, once `start`ed
        self.group = 0 if guardian is None else guardian.pid  # 0: the command's own, new
        self.lease = lease
        self.limits = limits
        self.log = log
        self.guardian = guardian
        self.terminal = False
        self.reaped = False
        # Threads that ran before lockrun blocked SIGCHLD (a library's, the API's renewals
        # thread): one of them may take the command's. Those lockrun starts inherit the block.
        self.foreign = threading.active_count() > 1
        self.forward = forward  # the signals passed on to the command
        self.clock = LeaseClock(
            lease.ttl, lease.confirmed, every=limits.refresh_every, kill_after=limits.kill_after
        )
        self.asking: _Ask | None = None
        # A lease's bells are made once its command runs: a server's just after the spawn
        # (`arm_bells`), a local lock's `LOCAL_BELL_AFTER` into the run.
        self.local = lease.ttl is None
        self.bells: tuple[int, ...] = ()
        self.hangups = _Hangups(lease.sessions)
        self.bells_due: float | None = None
        self.time_limit: float | None = None
        self.kill_at: float | None = None
        self.failure: LeaseLost | TimedOut | TakenOver | None = None

    def confirm_before_start(self) -> None:
        """Renew a lease that a stall since the grant has left due, before anything runs.

        Nothing ran either way: `LeaseLost` (76) if the server says it is gone, as for any
        lost lock, and `BackendUnavailable` (69) if the server cannot be asked.
        """
        if self.lease.ttl is None or now() < self.clock.next_refresh:
            self._expect()
            return
        sent = now()
        try:
            self.lease.refresh()
        except (LeaseLost, BackendUnavailable) as err:
            msg = f"the lease could not be confirmed before the command started: {err}; nothing ran"
            raise type(err)(msg) from err
        self._confirm(sent, Answer.HELD)

    def start(self, pid: int) -> None:
        """Watch *pid*, the command just spawned; KILL it if the lease ran out meanwhile.

        The spawn itself can stall (a frozen cgroup, memory pressure, a tracer holding
        clone3) past the lease's deadline, and past the guardian's KILL, which found the
        group empty then. Such a command never had the lock: no grace, not even TERM.
        """
        self.pid = pid
        self.group = self.group or pid
        if self.local:
            self.bells_due = now() + LOCAL_BELL_AFTER
        if self.limits.max_time is not None:
            self.time_limit = now() + self.limits.max_time
        if now() >= self.clock.deadline():
            self._signal_group(signal.SIGKILL)
            self.failure = LeaseLost(
                "the lease ran out while the command was started (lockrun stalled); "
                "killed it at once"
            )

    def _confirm(self, sent: float, answer: Answer) -> None:
        """Count the lease from *sent*, when the refresh that proved it went out."""
        self.clock.answered(sent, answer)
        self._expect()

    def _expect(self) -> None:
        """Give the guardian the deadline to enforce should we stop answering."""
        if self.guardian is None or self.lease.ttl is None:
            return
        late = self.limits.lost_kill_after
        if self.failure is not None:  # stopping already: our KILL time is what remains
            self.guardian.expect(math.inf, self.kill_at or now(), late)
            return
        # Halfway between the latest TERM of ours (a refresh that hangs is a doubt only
        # after _RETRY) and the deadline: while we run, we send it, not both; a stopped
        # lockrun's command still gets some grace, and KILL lands when ours would.
        deadline, ours = self.clock.deadline(), self.clock.latest_term()
        self.guardian.expect(ours + (deadline - ours) / 2, deadline, late)

    @contextlib.contextmanager
    def stopping_on_error(self) -> Iterator[None]:
        """Stop the command (TERM, grace, KILL, reap) if the block fails before it was reaped."""
        try:
            yield
        except BaseException:
            if not self.reaped:
                self._stop_now()
            raise

    def run(self) -> int:
        """Wait for the command, serving signals and timers; stop it on any failure of ours."""
        try:
            # SIGCHLD is blocked in this thread only: while it is not waiting (arming the
            # watchers after the spawn), another thread of the process that does not block
            # it (a library's, the API's renewals thread) may take it, and the kernel drops
            # it there. So the loop reaps once before its first wait and at every timer,
            # and waits no longer than REAP_EVERY where such a thread lives.
            status = self._reap()
            while status is None:
                timer = self._next_timer()
                if self.foreign:
                    timer = min(timer, now() + REAP_EVERY)
                info = (
                    signal.sigwaitinfo(_WATCHED)
                    if timer == float("inf")  # all done but waiting for the command to end
                    else signal.sigtimedwait(_WATCHED, max(0.0, timer - now()))
                )
                if info is None or not genuine(info):
                    self._on_timer()
                    status = self._reap()
                else:
                    status = self._on_signal(info.si_signo)
            return self._outcome(status)
        except BaseException:
            if not self.reaped:
                self._stop_now()
            raise

    def _on_signal(self, signo: int) -> int | None:
        """Serve a signal of ours; return the command's status once it ended."""
        if signo == signal.SIGCHLD:
            return self._reap()
        if signo == _HANGUP:
            self._on_hangup()
        elif signo == _BELL:
            self.clock.ring()  # asked at the next timer, or after the refresh under way
        elif signo in self.forward:
            self._signal_group(signo)
        return None

    def _next_timer(self) -> float:
        timers = []
        if self.failure is None:
            if self.bells_due is not None:
                timers.append(self.bells_due)
            if self.asking is not None:
                timers.append(now() + _POLL)
            else:
                timers.append(max(now(), self.clock.refresh_due()))
            if self.clock.doubt is not None:
                timers.append(self.clock.term_due())
            timers.append(self.clock.deadline())
            if self.time_limit is not None:
                timers.append(self.time_limit)
        if self.kill_at is not None:
            timers.append(self.kill_at)
        return min(timers, default=float("inf"))

    def _on_timer(self) -> None:
        """Do what is due: KILL, the time limit, a renewal's outcome, the lease clock."""
        current = now()
        if self.kill_at is not None and current >= self.kill_at:
            self._signal_group(signal.SIGKILL)
            self.kill_at = None
        self._make_bells(current)
        if self.failure is None and not self._timed_out(current) and not self._collect(current):
            self._on_clock(current)

    def arm_bells(self) -> None:
        """Make a server lease's bells and watch them; a local lock's wait (`_make_bells`)."""
        if not self.local:
            self.bells = tuple(self.lease.bells)
            self.hangups.ring_on(self.bells)

    def _make_bells(self, current: float) -> None:
        """Make a local lock's bells once they are due (`LOCAL_BELL_AFTER`), and watch them."""
        if self.failure is None and self.bells_due is not None and current >= self.bells_due:
            self.bells_due = None
            self.bells = self.lease.bells
            self.hangups.ring_on(self.bells)
            # What a bell would have heard before it was made (a taker's request, a lock
            # file deleted), a refresh finds now.
            self.clock.ring()

    def _timed_out(self, current: float) -> bool:
        """Begin the stop if --max-time is up; return whether it was."""
        if self.time_limit is None or current < self.time_limit:
            return False
        limit = format_duration(self.limits.max_time or 0.0)
        self._begin_stop(TimedOut(f"--max-time {limit} expired; stopped the command"))
        return True

    def _on_clock(self, current: float) -> None:
        """Act on the lease clock's verdict: stop for a lost or doubted lease, or renew."""
        verdict = self.clock.verdict(current)
        if verdict is Verdict.LOST:
            # A lockrun that could not run (a stop, a stall before the spawn), or a lease
            # too short for a refresh to be doubted first: it may be someone else's now.
            # The guardian has acted already, unless the command started after it did.
            # Woken past it: as for a lock known lost, TERM and a short grace.
            self._begin_stop(self._unconfirmed(), kill_by=current + self.limits.lost_kill_after)
        elif verdict is Verdict.GIVE_UP:
            # The lease may still be ours: the grace must not outlast it.
            lost = LeaseLost(f"lease could not be confirmed: {self.clock.doubt}")
            self._begin_stop(lost, kill_by=self.clock.deadline())
        elif current >= self.clock.refresh_due():
            self.asking = _Ask(self.lease)
            self.clock.sending(self.asking.sent)

    def _on_hangup(self) -> None:
        """Stop at once if the server closed a session of the lease (not for a stray SIGURG)."""
        if self.failure is None and hung_up(self.lease.sessions):
            lost = "the session holding the lock ended (the server hung up); its locks are gone"
            self._begin_stop(LeaseLost(lost), kill_by=now() + self.limits.lost_kill_after)

    def _collect(self, current: float) -> bool:
        """Take the outcome of a finished refresh (True: the lease is lost, stop begun).

        A refresh that hangs counts as a doubt after a second.
        """
        ask = self.asking
        if ask is None:
            return False
        if ask.is_alive():
            self.clock.waiting(current)
            return False
        self.asking = None
        # A bell that rang while the refresh ran may have been that refresh's own answer (a
        # bell on the session's socket: PostgreSQL's LISTEN). What the refresh read is
        # gone from the socket, so the bell counts only if one is still readable.
        self.clock.rung = self.clock.rung and readable(self.bells)
        if ask.error is None:
            self._confirm(ask.sent, Answer.HELD)
        elif isinstance(ask.error, TakenOver):  # still ours, proved: stop with the usual grace
            self._confirm(ask.sent, Answer.TAKEN)
            self._begin_stop(ask.error, kill_by=self.clock.deadline())
            return True
        elif isinstance(ask.error, LeaseLost):
            self.clock.answered(ask.sent, Answer.LOST)
            self._begin_stop(ask.error, kill_by=now() + self.limits.lost_kill_after)
            return True
        elif isinstance(ask.error, LockrunError):  # unavailable, or refused (a failover to
            # a server that no longer has our database): the lease is in doubt either way
            self.clock.answered(ask.sent, Answer.DOUBT, str(ask.error))
            self.log(f"lease not confirmed ({ask.error}); retrying")
        else:
            raise ask.error  # a bug: status 70, after _stop_now
        return False

    def _begin_stop(
        self, failure: LeaseLost | TimedOut | TakenOver, *, kill_by: float | None = None
    ) -> None:
        """TERM the group now, KILL after --kill-after (or at *kill_by*, if that is sooner)."""
        if self.failure is None:
            self.failure = failure
            self._signal_group(signal.SIGTERM)
            self.kill_at = now() + self.limits.kill_after
            if kill_by is not None:
                self.kill_at = min(self.kill_at, max(kill_by, now()))
            self._expect()

    def _signal_group(self, signo: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.group, signo)

    def _reap(self, *, follow_stops: bool = True) -> int | None:
        """Collect the command's status, or follow it into a terminal stop (Ctrl-Z)."""
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
            if pid == 0:
                return None
            if not os.WIFSTOPPED(status):
                self.reaped = True
                code = os.waitstatus_to_exitcode(status)
                return Killed(128 - code) if code < 0 else code
            if self.terminal and follow_stops:
                self._suspend_with_child()

    def _suspend_with_child(self) -> None:
        """Stop ourselves as the shell expects of a job, then resume the command with us."""
        with contextlib.suppress(OSError):
            os.tcsetpgrp(0, os.getpgrp())
        os.kill(os.getpid(), signal.SIGSTOP)
        # Continued by `fg` (the terminal is ours again) or `bg` (it is not).
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(0) == os.getpgrp():
                os.tcsetpgrp(0, self.group)
        self._signal_group(signal.SIGCONT)

    def _unconfirmed(self) -> LeaseLost:
        """Say why a lease that ran out unconfirmed stopped the command."""
        if self.clock.doubt is not None:  # we were about to stop it ourselves
            return LeaseLost(f"lease could not be confirmed: {self.clock.doubt}")
        if self.guardian is not None and self.guardian.acted():
            if self.asking is not None and self.asking.is_alive():  # the server's silence
                silent = now() - self.asking.sent
                return LeaseLost(
                    f"lease could not be confirmed: no answer for {silent:.1f}s; "
                    "its guardian stopped the command before the lease ran out"
                )
            return LeaseLost(
                "lockrun could not renew the lease in time (was it stopped or starved?); "
                "its guardian stopped the command before the lease ran out"
            )
        return LeaseLost("lease could not be confirmed: no answer in time")

    def _outcome(self, status: int) -> int:
        if self.failure is None and self.guardian is not None and self.guardian.acted():
            self.failure = self._unconfirmed()
        if self.failure is not None:
            self._signal_group(signal.SIGKILL)  # stragglers of a stopped group
            raise self.failure
        self._stop_stragglers()
        return status

    def _stop_stragglers(self) -> None:
        """Stop what the command left running in its group before the lock is released.

        docs/semantics.md G2: only a descriptor of the lock keeps it (`file:`); in the
        guardian's group anything left would run on without it, and the kernel's switch
        would kill it once lockrun is gone anyway. TERM first, KILL after --kill-after.
        """
        guardian = self.guardian
        # Two system calls first, where /proc is a read of every process.
        if guardian is None or not guardian.left_behind() or not self._stragglers():
            return
        self.log("the command left processes running in its group; stopping them")
        self._signal_group(signal.SIGTERM)  # the guardian ignores it
        self._signal_group(signal.SIGCONT)
        deadline, pause = now() + self.limits.kill_after, 0.001
        while self._stragglers() and now() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        kill_the_others(self.group, spare=guardian.pid)

    def _stragglers(self) -> list[int]:
        """Return the live processes of the command's group, the guardian left out."""
        spare = 0 if self.guardian is None else self.guardian.pid
        return [pid for pid in members(self.group) if pid != spare]

    def _stop_now(self) -> None:
        """Stop the command after an error of ours: TERM, grace, KILL, reap."""
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)  # a stopped command must run to take TERM
        deadline = now() + self.limits.kill_after
        while self._reap(follow_stops=False) is None:
            if now() >= deadline:
                self._signal_group(signal.SIGKILL)
                os.waitpid(self.pid, 0)
                self.reaped = True
                return
            signal.sigtimedwait({signal.SIGCHLD}, max(0.0, deadline - now()))
