"""What a run tells its monitors: the hooks (--on-start, --on-busy, --on-exit) and metrics.

docs/semantics.md "Monitoring" is the contract: when each hook runs and how, what it is told,
and that neither a hook nor the metrics file ever changes lockrun's exit status or keeps the
lock a moment longer: ``--on-start`` runs beside the command, the rest after the release. The
runner notes the run in an `Account` as it goes, and closes it with the status it is about to
exit with.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import threading
import time
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun import metrics
from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    ExitCode,
    LeaseLost,
    LockBusy,
    LockrunError,
    TakenOver,
    TimedOut,
    out_of_files,
)
from lockrun.sigmask import pthread_sigmask, valid_signals
from lockrun.supervise import FORWARDED, Killed, genuine
from lockrun.timing import format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import Request
    from lockrun.runner import Options

SHELL: Final = "/bin/sh"
HOOK_GRACE: Final = 1.0  # between TERM and KILL to a hook that outlived --hook-max-time
# Held while lockrun reports: a forwarded signal goes to the hook, the hook's end wakes us.
_WATCHED: Final = FORWARDED | {signal.SIGCHLD}
_DEFAULTED: Final = (signal.SIGPIPE, signal.SIGXFSZ)  # as for the command (supervise.py)
_POLL: Final = 0.02  # how soon a signal reaches an --on-start hook that outlives the command
# How long a run holds the lock before its start is recorded on its own: a shorter run is
# recorded once, at its end, with its start (docs/semantics.md "Metrics", issue #32).
START_RECORD_AFTER: Final = 1.0
# What lockrun tells the command (docs/semantics.md "What the command is told") and the
# hooks' own: a hook of a lockrun nested in a locked job must not see its parent's, and an
# --on-start hook none of the end's (a script shared by the hooks tells them apart so).
_HELD: Final = frozenset(
    {
        "LOCKRUN_SLOT",
        "LOCKRUN_FENCE",
        "LOCKRUN_STARTED_AT",
        "LOCKRUN_ENDED_AT",
        "LOCKRUN_DURATION",
        "LOCKRUN_STATUS",
        "LOCKRUN_OUTCOME",
    }
)


class Run(NamedTuple):
    """One run as its monitors see it (docs/semantics.md "Monitoring")."""

    namespace: str
    name: str
    uri: str  # redacted: no password
    slots: int
    status: int  # what lockrun exits with
    outcome: str  # LOCKRUN_OUTCOME
    waited: float  # seconds, until the grant or until lockrun gave up
    slot: int | None = None  # None: it never got the lock
    fence: int | None = None
    started_at: float = 0.0  # Unix time of the grant
    ended_at: float = 0.0  # Unix time of the release
    duration: float = 0.0  # seconds the lock was held


def outcome(result: int | BaseException, *, held: bool) -> str | None:
    """Name how a run ended (LOCKRUN_OUTCOME); None for an end that no monitor is told of."""
    if not held:  # a waiter that gave way to a taker was skipped as much as a busy one
        skipped = {LockBusy: "busy", TakenOver: "taken-over"}
        return next((word for kind, word in skipped.items() if isinstance(result, kind)), None)
    if isinstance(result, int):
        return "ok" if result == 0 else "killed" if isinstance(result, Killed) else "failed"
    named: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
        (TimedOut, "timed-out"),
        (LeaseLost, "lost"),
        (TakenOver, "taken-over"),
        ((CommandNotFound, CommandNotExecutable, BackendUnavailable), "not-run"),
    )
    return next((word for kind, word in named if isinstance(result, kind)), "error")


def environment(run: Run, *, ended: bool = True) -> dict[str, str]:
    """Return a hook's environment: lockrun's, with what it knows of *run*.

    Not *ended* (``--on-start``): nothing of the end, no status, outcome, end or duration.
    """
    env = {key: value for key, value in os.environ.items() if key not in _HELD}
    env |= {
        "LOCKRUN_URI": run.uri,
        "LOCKRUN_NAMESPACE": run.namespace,
        "LOCKRUN_NAME": run.name,
        "LOCKRUN_SLOTS": str(run.slots),
        "LOCKRUN_WAITED": f"{run.waited:.3f}",
    }
    if ended:
        env |= {"LOCKRUN_STATUS": str(run.status), "LOCKRUN_OUTCOME": run.outcome}
    if run.slot is not None:
        env["LOCKRUN_SLOT"] = str(run.slot)
        env["LOCKRUN_STARTED_AT"] = f"{run.started_at:.3f}"
        if ended:
            env["LOCKRUN_ENDED_AT"] = f"{run.ended_at:.3f}"
            env["LOCKRUN_DURATION"] = f"{run.duration:.3f}"
        if run.fence is not None:
            env["LOCKRUN_FENCE"] = str(run.fence)
    return env


class Account:
    """What one run did, noted by the runner as it goes and told to its monitors at the end."""

    def __init__(
        self, options: Options, request: Request, uri: str, log: Callable[[str], None]
    ) -> None:
        """Start counting the wait of *request*, monitored as *options* say."""
        self.options = options
        self.request = request
        self.uri = uri
        self.log = log
        self.asked = now()
        self.granted: float | None = None  # `now` at the grant; None: never held
        self.started_at = self.ended_at = self.duration = 0.0
        self.slot = 0
        self.fence: int | None = None
        self.ignored: frozenset[int] = frozenset()  # under nohup: never forwarded to a hook
        self._starting: threading.Thread | None = None
        self._over = threading.Event()  # set once released: no start record on its own then
        self._beside: Beside | None = None  # the --on-start hook, once started
        self._said: set[str] = set()  # the start and the end record fail alike: one line

    def held(self, slot: int, fence: int | None) -> None:
        """Note the grant; record the start in the metrics file, beside the command.

        In a thread, so that no flock another process holds on the metrics directory can
        delay the command (or lengthen the hold). It takes no signal: they are the loop's.
        Only once the run has held the lock `START_RECORD_AFTER`: the end's record carries
        the start too, so a shorter run writes the file once, not twice.
        """
        self.granted, self.started_at = now(), time.time()
        self.slot, self.fence = slot, fence
        if self.options.metrics_file:
            self._starting = threading.Thread(
                target=self._record_start, name="lockrun-metrics", daemon=True
            )
            saved = pthread_sigmask(signal.SIG_BLOCK, valid_signals())
            try:
                self._starting.start()
            finally:
                pthread_sigmask(signal.SIG_SETMASK, saved)

    def starting(self) -> None:
        """Start the ``--on-start`` hook: the lock is held and the command is about to start.

        Called just before the command's spawn, and never waited for: it runs beside the
        command (docs/semantics.md "Monitoring"). Spawned from here rather than from a
        thread, because the lock's descriptors are still close-on-exec here (the command's
        spawn makes them inheritable): a hook must never hold the lock.
        """
        command = self.options.on_start
        if not command or self.granted is None:
            return
        run = Run(
            namespace=self.request.namespace,
            name=self.request.name,
            uri=self.uri,
            slots=self.request.slots,
            status=0,
            outcome="",
            waited=self.granted - self.asked,
            slot=self.slot,
            fence=self.fence,
            started_at=metrics.stamp(self.started_at),
        )
        self._beside = Beside.start(
            "--on-start",
            command,
            run,
            max_time=self.options.hook_max_time,
            forward=FORWARDED - self.ignored,
            log=self.log,
        )

    def released(self) -> None:
        """Note the end of the hold: the command has ended and the lock is given back."""
        self._over.set()
        if self.granted is not None:
            self.duration, self.ended_at = now() - self.granted, time.time()

    def close(self, result: int | BaseException, *, conflict: int) -> None:
        """Tell the monitors how the run ended: *result* is its status or what was raised.

        *conflict* is the status of busy (``-E``). Nothing is told of a run that neither got
        the lock nor found it busy (a usage error, an unreachable server, Ctrl-C).
        """
        self._over.set()
        if self._starting is not None:
            self._starting.join()
        word = outcome(result, held=self.granted is not None)
        if word is None:  # nothing was held: no --on-start hook ran either
            return
        if isinstance(result, int):
            status = int(result)
        elif isinstance(result, LockBusy):
            status = conflict
        else:
            status = (
                result.exit_code
                if isinstance(result, LockrunError)
                else ExitCode.OSERR
                if out_of_files(result)
                else ExitCode.SOFTWARE
            )  # as the CLI's exit status says (cli._unforeseen)
        run = Run(
            namespace=self.request.namespace,
            name=self.request.name,
            uri=self.uri,
            slots=self.request.slots,
            status=status,
            outcome=word,
            waited=(now() if self.granted is None else self.granted) - self.asked,
        )
        if self.granted is not None:
            run = run._replace(
                slot=self.slot,
                fence=self.fence,
                started_at=metrics.stamp(self.started_at),
                ended_at=metrics.stamp(self.ended_at),
                duration=metrics.stamp(self.duration),
            )
        self._report(run)

    def _report(self, run: Run) -> None:
        """Record *run* in the metrics file, then run its hook; the lock is no longer held.

        The signals lockrun forwards go to the hook while it runs, as they went to the
        command; one that finds no hook to take it changes nothing: the status stands.
        """
        saved = pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
        try:
            self._record(lambda locks: _ended(locks, run))
            if self._beside is not None:  # a monitor must hear the start before the end
                self._beside.wait()
            held = run.slot is not None
            command = self.options.on_exit if held else self.options.on_busy
            if command:
                option = "--on-exit" if held else "--on-busy"
                max_time = self.options.hook_max_time
                hook(option, command, run, max_time=max_time, ignored=self.ignored, log=self.log)
        finally:
            while signal.sigtimedwait(_WATCHED, 0) is not None:
                pass
            pthread_sigmask(signal.SIG_SETMASK, saved)

    def _record_start(self) -> None:
        if not self._over.wait(START_RECORD_AFTER):
            self._record(self._started)

    def _record(self, change: Callable[[metrics.Locks], None]) -> None:
        if self.options.metrics_file:
            metrics.update(self.options.metrics_file, change, log=self._say_once)

    def _say_once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self.log(f"{self.request.name}: {line}")

    def _started(self, locks: metrics.Locks) -> None:
        values = metrics.counted(locks, (self.request.namespace, self.request.name))
        start = ("lockrun_last_start_timestamp_seconds", "")
        values[start] = max(values.get(start, 0.0), metrics.stamp(self.started_at))


def _ended(locks: metrics.Locks, run: Run) -> None:
    """Count *run* in *locks*; a run that got the lock is also the last run."""
    values = metrics.counted(locks, (run.namespace, run.name))
    if run.slot is None:
        metrics.bump(values, ("lockrun_skipped_total", ""))
        return
    metrics.bump(values, ("lockrun_runs_total", run.outcome))
    start = ("lockrun_last_start_timestamp_seconds", "")
    values[start] = max(values.get(start, 0.0), run.started_at)  # a later slot's may be there
    values[("lockrun_last_end_timestamp_seconds", "")] = run.ended_at
    values[("lockrun_last_duration_seconds", "")] = run.duration
    values[("lockrun_last_exit_status", "")] = float(run.status)
    if run.status == 0:
        values[("lockrun_last_success_timestamp_seconds", "")] = run.ended_at


def hook(
    option: str,
    command: str,
    run: Run,
    *,
    max_time: float,
    ignored: frozenset[int],
    log: Callable[[str], None],
) -> None:
    """Run *command* with ``/bin/sh -c`` for *run*; one line to *log* if it fails.

    Its stdin is /dev/null and its stdout goes to lockrun's stderr (lockrun's stdout is
    the command's data, which a ping's "OK" must not join). It runs in a process group of
    its own, which gets TERM after *max_time* and KILL `HOOK_GRACE` later. Called with
    `_WATCHED` blocked.
    """
    forward = FORWARDED - ignored
    pid = _spawn(option, command, run.name, environment(run), forward, log)
    if pid is not None:
        _judge(option, run.name, _reap(pid, max_time, forward), max_time, log)


def _spawn(
    option: str,
    command: str,
    name: str,
    env: dict[str, str],
    forward: frozenset[int],
    log: Callable[[str], None],
) -> int | None:
    """Start the hook *command* in a process group of its own; None (and a line) if we cannot."""
    try:
        return os.posix_spawn(
            SHELL,
            [SHELL, "-c", command],
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, 2, 1),
            ],
            setpgroup=0,
            setsigmask=(),
            setsigdef=(*forward, *_DEFAULTED),
        )
    except OSError as err:
        log(f"{name}: {option} hook: cannot run {SHELL}: {err.strerror}")
        return None


def _judge(
    option: str, name: str, code: int | None, max_time: float, log: Callable[[str], None]
) -> None:
    """Say how a hook that did not succeed ended: *code* as `_reap` returns it."""
    if code is None:
        limit = format_duration(max_time)
        log(f"{name}: {option} hook still ran after {limit} (--hook-max-time): stopped it")
    elif code < 0:
        log(f"{name}: {option} hook was killed by {signal.Signals(-code).name}")
    elif code > 0:
        log(f"{name}: {option} hook exited {code}")


class Beside:
    """A hook that runs beside the command (``--on-start``), bounded and reaped by a thread.

    The thread waits on a pidfd, never for a signal: while the command runs, SIGCHLD and
    the signals lockrun forwards are the supervision loop's (`lockrun.supervise`).
    """

    def __init__(
        self,
        pid: int,
        option: str,
        name: str,
        *,
        max_time: float,
        forward: frozenset[int],
        log: Callable[[str], None],
    ) -> None:
        """Watch the hook *pid*, just spawned, from a thread of its own (`start` makes one)."""
        self.pid = pid
        self.max_time = max_time
        self.forward = forward
        self._reaping = threading.Lock()  # no signal for pid once the thread has reaped it
        self._reaped = False
        self._thread = threading.Thread(
            target=lambda: _judge(option, name, self.reap(), max_time, log),
            name="lockrun-on-start",
            daemon=True,
        )
        # With every signal blocked, none is delivered to it (as lockrun.progress says).
        saved = pthread_sigmask(signal.SIG_BLOCK, valid_signals())
        try:
            self._thread.start()
        finally:
            pthread_sigmask(signal.SIG_SETMASK, saved)

    @classmethod
    def start(
        cls,
        option: str,
        command: str,
        run: Run,
        *,
        max_time: float,
        forward: frozenset[int],
        log: Callable[[str], None],
    ) -> Beside | None:
        """Spawn *command* for *run*, which has not ended, and watch it; None if it cannot run."""
        pid = _spawn(option, command, run.name, environment(run, ended=False), forward, log)
        if pid is None:
            return None
        return cls(pid, option, run.name, max_time=max_time, forward=forward, log=log)

    def reap(self) -> int | None:
        """Wait for the hook, stop it after its time; return as `_reap` does. In the thread."""
        pidfd = os.pidfd_open(self.pid)
        try:
            ended = select.poll()
            ended.register(pidfd, select.POLLIN)
            stopped = not ended.poll(math.ceil(self.max_time * 1000))
            if stopped:
                self._signal(signal.SIGTERM)
                self._signal(signal.SIGCONT)  # a stopped hook must run to take it
                if not ended.poll(math.ceil(HOOK_GRACE * 1000)):
                    self._signal(signal.SIGKILL)
        finally:
            os.close(pidfd)
        with self._reaping:
            _, status = os.waitpid(self.pid, 0)  # KILLed, or ended: at once
            self._reaped = True
        return None if stopped else os.waitstatus_to_exitcode(status)

    def wait(self) -> None:
        """Wait for the thread, passing the hook the signals lockrun gets meanwhile.

        Called with `_WATCHED` blocked, once the command has ended: signals are lockrun's
        to take again.
        """
        while self._thread.is_alive():
            self._thread.join(_POLL)
            while (info := signal.sigtimedwait(_WATCHED, 0)) is not None:
                if genuine(info) and info.si_signo in self.forward:
                    self._signal(info.si_signo)

    def _signal(self, signo: int) -> None:
        """Send *signo* to the hook's group and the hook, unless it has been reaped."""
        with self._reaping:
            if not self._reaped:
                _signal_hook(self.pid, signo)


def _reap(pid: int, max_time: float, forward: frozenset[int]) -> int | None:
    """Wait for the hook *pid*, passing it the signals of *forward*; stop it after *max_time*.

    Return its exit code (negative: the signal that ended it), or None if it was stopped.
    """
    deadline, stopping = now() + max_time, False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return None if stopping else os.waitstatus_to_exitcode(status)
        if now() >= deadline:
            if stopping:
                _signal_hook(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # our child, killed itself: whatever group it moved to
                return None
            _signal_hook(pid, signal.SIGTERM)
            _signal_hook(pid, signal.SIGCONT)  # a stopped hook must run to take it
            deadline, stopping = now() + HOOK_GRACE, True
        info = signal.sigtimedwait(_WATCHED, max(0.0, deadline - now()))
        if info is not None and genuine(info) and info.si_signo in forward:
            _signal_hook(pid, info.si_signo)


def _signal_hook(pid: int, signo: int) -> None:
    """Send *signo* to the hook's process group, and to the hook itself if it left it.

    A hook may move itself to another group (setpgid): the group's signal would miss it,
    and the wait for it would have no end.
    """
    for send, target in ((os.killpg, pid), (os.kill, pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
            send(target, signo)
