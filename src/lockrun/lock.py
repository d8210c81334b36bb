"""Acquire, hold and release: the backend-independent policy and the Python API (SPEC §5)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Final, NamedTuple, ParamSpec, TypeVar

from lockrun.backends import (
    Backend,
    Holder,
    Lease,
    LockState,
    Request,
    open_backend,
    parse_uri,
)
from lockrun.bounds import (
    MAX_KILL_AFTER,
    MAX_WAIT,
    check_seconds,
    check_slots,
    check_ttl,
    check_wait,
)
from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    ConfigError,
    Interrupted,
    LeaseLost,
    LockBusy,
    TimedOut,
    UsageError,
)
from lockrun.names import check_name, default_name
from lockrun.progress import WaitReport
from lockrun.supervise import FORWARDED, Guardian, Limits, supervise
from lockrun.timing import clock_time, format_duration, now
from lockrun.uri import DEFAULT_URI, redact

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from types import FrameType, TracebackType

DEFAULT_NAMESPACE: Final = "default"
DEFAULT_TTL: Final = 30.0
DEFAULT_KILL_AFTER: Final = 10.0
# Once the lock is known gone someone else may hold it: a short grace (README "Guarantees").
DEFAULT_LOST_KILL_AFTER: Final = 1.0
_P = ParamSpec("_P")
_R = TypeVar("_R")


def acquire(backend: Backend, request: Request, wait: float | None) -> Lease:
    """Hold one slot of *request*, waiting up to *wait* seconds (None: forever; 0: one try)."""
    deadline = None if wait is None else now() + wait
    lease = backend.acquire(request, deadline)
    if lease is None:
        raise LockBusy(_busy_message(backend, request, wait))
    return lease


def _busy_message(backend: Backend, request: Request, wait: float | None) -> str:
    what = request.name if request.slots == 1 else f"all {request.slots} slots of {request.name}"
    message = f"{what} busy" if request.slots == 1 else f"{what} taken"
    holders = describe_holders(backend, request)
    if holders:
        message += f", held by {holders}"
    if wait:
        message += f"; gave up after {format_duration(wait)}"
    return message


def describe_holders(backend: Backend, request: Request) -> str:
    """Name who holds *request*'s lock, for people: ``alice@web1 pid 42 since 12:03:04``."""
    states = backend.status(request.namespace, request.name)
    holders = [holder for state in states for holder in state.holders]
    return "; ".join(describe(holder) for holder in holders)


def describe(holder: Holder) -> str:
    """Render one holder in a line."""
    text = f"{holder.user}@{holder.host} pid {holder.pid}"
    if holder.since is not None:
        text += f" since {clock_time(holder.since)}"
    return text


class Lock:
    """A named lock (or one slot of an N-slot semaphore) as context manager and decorator.

    ``with Lock("sales", slots=3, wait=60) as lease:`` holds a slot for the block;
    ``lease.slot`` and ``lease.fence`` say which slot and which fence token. ``wait`` is
    seconds, 0 (the default) tries once, None waits forever; a busy lock raises `LockBusy`.
    """

    def __init__(
        self,
        name: str,
        *,
        uri: str | None = None,
        slots: int = 1,
        wait: float | None = 0,
        ttl: float = DEFAULT_TTL,
        namespace: str | None = None,
    ) -> None:
        """Describe the lock; nothing is acquired yet. URI and namespace default as in the CLI.

        Bad values raise `UsageError` (numbers: see `lockrun.bounds`), a bad URI `ConfigError`.
        ``wait=math.inf`` waits forever, as None does.
        """
        self.name = check_name(name)
        namespace = namespace or os.environ.get("LOCKRUN_NAMESPACE") or DEFAULT_NAMESPACE
        self.namespace = check_name(namespace, "namespace")
        self.uri = uri or os.environ.get("LOCKRUN_URI") or DEFAULT_URI
        self._uri = parse_uri(self.uri)  # a bad one is the caller's mistake: said now
        self.slots = check_slots(slots)
        self.wait = check_wait(wait)
        self.ttl = check_ttl(ttl)
        self._local = threading.local()  # each thread releases what it acquired

    def acquire(self) -> Lease:
        """Take a slot, waiting as configured; raise `LockBusy` if none came free.

        A lease of a remote backend is renewed every ttl/3 by a thread until `release`.
        """
        backend = open_backend(self._uri, ttl=self.ttl)
        request = Request(self.namespace, self.name, self.slots, self.ttl, Holder.me(sys.argv))
        try:
            lease = acquire(backend, request, self.wait)
        except BaseException:
            backend.close()
            raise
        try:
            renewer = None if lease.ttl is None else _Renewer(lease)
            self._held().append((backend, lease, renewer))
        except BaseException:  # e.g. Ctrl-C right after the grant: leave nothing held
            lease.release()
            backend.close()
            raise
        return lease

    def release(self) -> None:
        """Release the most recently acquired slot.

        Raises `LeaseLost` if a renewal found the lease gone while it was held: the code
        under the lock may have overlapped with another holder's.
        """
        backend, lease, renewer = self._held().pop()
        try:
            if renewer is not None:
                renewer.stop()
            lease.release()
        finally:
            backend.close()
        if renewer is not None and renewer.lost is not None:
            raise renewer.lost

    def _held(self) -> list[tuple[Backend, Lease, _Renewer | None]]:
        """Return the calling thread's leases, most recent last."""
        held: list[tuple[Backend, Lease, _Renewer | None]]
        try:
            held = self._local.held
        except AttributeError:
            held = self._local.held = []
        return held

    def __enter__(self) -> Lease:
        """Acquire and return the lease."""
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Release."""
        self.release()

    def __call__(self, function: Callable[_P, _R]) -> Callable[_P, _R]:
        """Hold the lock around every call of *function*."""

        @functools.wraps(function)
        def locked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self:
                return function(*args, **kwargs)

        return locked


class _Renewer(threading.Thread):
    """Renews an API lease every ttl/3; remembers a loss for `Lock.release` to raise."""

    def __init__(self, lease: Lease) -> None:
        super().__init__(name="lockrun-renewer", daemon=True)
        self.lease = lease
        self.lost: LeaseLost | None = None
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        ttl = self.lease.ttl or 0.0
        confirmed = self.lease.confirmed  # counted from the request, as in supervise.py
        every = max(0.0, confirmed + ttl / 3 - now())
        while not self.stopping.wait(every):
            sent = now()
            try:
                self.lease.refresh()
            except LeaseLost as err:
                self.lost = err
                return
            except Exception as err:  # noqa: BLE001 - unavailable, refused, a reply askew: a doubt
                if now() - confirmed >= ttl:
                    self.lost = LeaseLost(f"lease could not be confirmed: {err}")
                    return
                every = 1.0
            else:
                confirmed = sent
                every = max(0.0, sent + ttl / 3 - now())

    def stop(self) -> None:
        self.stopping.set()
        self.join()


class Options(NamedTuple):
    """The CLI's options (SPEC §1), with durations in seconds and None for forever/none."""

    name: str | None = None
    uri: str = DEFAULT_URI
    slots: int = 1
    wait: float | None = 0.0
    ttl: float = DEFAULT_TTL
    max_time: float | None = None
    kill_after: float = DEFAULT_KILL_AFTER
    namespace: str = DEFAULT_NAMESPACE
    close: bool = False
    verbose: bool = False
    lost_kill_after: float = DEFAULT_LOST_KILL_AFTER


def run(
    argv: Sequence[str],
    options: Options,
    *,
    log: Callable[[str], None],
    live: Callable[[str], None] | None = None,
) -> int:
    """Run *argv* under the lock of *options*; return its status (see SPEC §2 for raises).

    *log* gets lockrun's lines. With *live* (a terminal), ``-v`` shows the wait as one line
    that *live* redraws in place; an empty string erases it.

    Meant for a process that exits with the result: once the lock was held, INT, TERM and
    HUP are left ignored, so a late signal cannot replace the command's status.
    """
    uri = parse_uri(options.uri)
    if options.close and not uri.kind.inherits_fds:
        msg = f"--close applies to the file: backend only, not {uri.scheme}:"
        raise UsageError(msg)
    check_options(options)
    name = check_name(options.name) if options.name is not None else default_name(argv)
    namespace = check_name(options.namespace, "namespace")
    verbose = log if options.verbose else lambda _line: None
    if options.name is None:
        verbose(f"lock name {name} (derived from the command; set it with --name)")
    request = Request(namespace, name, options.slots, options.ttl, Holder.me(argv))
    with _interruptible(name, verbose) as waiting:
        backend = open_backend(uri, ttl=options.ttl, warn=log, note=verbose)
        # Only lock fds the command inherits keep the lock if we die; otherwise a guardian
        # must take the command's group down with us (SPEC §4.2).
        guardian = Guardian() if options.close or not uri.kind.inherits_fds else None
        try:
            report = (
                WaitReport(request, uri, log=log, live=live)
                if options.verbose and options.wait != 0
                else None
            )
            return _hold_and_run(
                backend, request, argv, options, verbose, guardian, waiting, report
            )
        finally:
            if guardian is not None:
                guardian.stand_down()
            backend.close()


def _hold_and_run(
    backend: Backend,
    request: Request,
    argv: Sequence[str],
    options: Options,
    verbose: Callable[[str], None],
    guardian: Guardian | None,
    waiting: _Waiting,
    report: WaitReport | None,
) -> int:
    started = now()
    try:
        if report is not None:
            try:
                states = backend.status(request.namespace, request.name)
            except BackendUnavailable:  # only a report: acquire() judges the outage itself
                states = []
            report.start(states)
        lease = acquire(backend, request, options.wait)
    except BaseException as err:
        if report is not None:
            report.stop()
        if isinstance(err, BackendUnavailable | ConfigError):  # SPEC §2: the line names the lock
            raise type(err)(f"{request.name}: {err}") from err
        raise
    held_since = started  # for the message only; set again at once
    # From here on the signals of FORWARDED belong to the command: supervise() forwards them
    # while it runs, and one that comes after it ended must not rewrite its exit status. One
    # that lands before they are deferred still finds the slot released by the finally below.
    try:
        held_since = now()
        with _deferred(FORWARDED):
            waiting.over = True
            if report is not None:  # here, where a signal cannot skip the release
                report.stop()
            fence = "" if lease.fence is None else f", fence {lease.fence}"
            verbose(
                f"acquired {request.name} slot {lease.slot} of {request.slots} "
                f"after {format_duration(now() - started)}{fence}"
            )
            limits = Limits(
                options.ttl / 3,
                options.max_time,
                options.kill_after,
                min(options.kill_after, options.lost_kill_after),
            )
            if guardian is not None:
                guardian.keep(lease.fds)
            return supervise(
                argv,
                lease,
                limits,
                env=command_environment(request, lease),
                pass_fds=lease.fds if guardian is None else (),
                guardian=guardian,
                forward=FORWARDED - waiting.ignored,  # not what nohup had us ignore
                log=verbose,
            )
    except (
        LeaseLost,
        TimedOut,
        CommandNotFound,
        CommandNotExecutable,
        BackendUnavailable,  # the lease could not be confirmed before the spawn
    ) as err:
        # SPEC §2: every lockrun-made status line names the lock.
        raise type(err)(f"{request.name}: {err}") from err
    finally:
        lease.release()
        verbose(f"released {request.name} after {format_duration(now() - held_since)}")


def check_options(options: Options) -> None:
    """Raise `UsageError` for a number of *options* out of its bounds (`lockrun.bounds`)."""
    check_slots(options.slots, "--slots")
    check_wait(options.wait, "--wait")
    check_ttl(options.ttl, "--ttl")
    if options.max_time is not None:  # 0 would stop every command
        check_seconds(options.max_time, "--max-time", high=MAX_WAIT, above=True)
    check_seconds(options.kill_after, "--kill-after", high=MAX_KILL_AFTER)
    check_seconds(options.lost_kill_after, "--lost-kill-after", high=MAX_KILL_AFTER)


def command_environment(request: Request, lease: Lease) -> dict[str, str]:
    """Return the command's environment: ours plus LOCKRUN_NAME/SLOT/SLOTS/FENCE."""
    env = dict(os.environ)
    if "LOCKRUN_URI" in env:
        # No password reaches the command; a lockrun it runs finds *** in the URI and
        # refuses it (78) rather than fall back to file: (README "Security model").
        env["LOCKRUN_URI"] = redact(env["LOCKRUN_URI"])
    env |= {
        "LOCKRUN_NAME": request.name,
        "LOCKRUN_SLOT": str(lease.slot),
        "LOCKRUN_SLOTS": str(request.slots),
    }
    if lease.fence is not None:
        env["LOCKRUN_FENCE"] = str(lease.fence)
    else:
        env.pop("LOCKRUN_FENCE", None)
    return env


# While lockrun waits there is no command yet: these end the wait (exit 128+N, nothing held);
# USR1 and USR2 are noted under -v and dropped. Once the command runs, every signal of
# FORWARDED is the command's (supervise.py).
_INTERRUPTS: Final = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})


class _Waiting:
    """Whether we still wait for the lock, and which signals the caller had us ignore."""

    def __init__(self) -> None:
        self.over = False
        self.ignored: frozenset[int] = frozenset()  # nohup's HUP: never forwarded either


@contextlib.contextmanager
def _interruptible(name: str, log: Callable[[str], None]) -> Iterator[_Waiting]:
    """Turn INT, TERM, HUP and QUIT into `Interrupted`: waits unwind and release what they hold."""
    waiting = _Waiting()

    def interrupt(signo: int, _frame: FrameType | None) -> None:
        if waiting.over:  # after the command: its status stands, lockrun is leaving anyway
            return
        what = signal.Signals(signo).name
        if signo not in _INTERRUPTS:
            log(f"{what} while waiting for {name}: no command yet to pass it to; dropped")
            return
        raise Interrupted(f"{what} while waiting for {name}; nothing is held", signo=signo)

    previous = {}
    ignored = set()
    for signo in FORWARDED:
        # Under nohup or `trap '' HUP` the signal stays ignored, for us and for the command.
        if signal.getsignal(signo) is signal.SIG_IGN:
            ignored.add(signo)
        else:
            previous[signo] = signal.signal(signo, interrupt)
    waiting.ignored = frozenset(ignored)
    try:
        yield waiting
    finally:
        for signo, handler in previous.items():
            # Once the lock was held, lockrun only finishes: the command's status stands.
            signal.signal(signo, signal.SIG_IGN if waiting.over else handler)


@contextlib.contextmanager
def _deferred(signals: frozenset[signal.Signals]) -> Iterator[None]:
    """Block *signals* for the block; drop those that arrived unclaimed before unblocking."""
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        while signal.sigtimedwait(signals, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)


def states_for_status(uri: str, namespace: str, name: str | None) -> list[LockState]:
    """Return what `lockrun status` shows."""
    if name is not None:
        check_name(name)
    backend = open_backend(parse_uri(uri))
    try:
        return backend.status(check_name(namespace, "namespace"), name)
    finally:
        backend.close()


__all__ = ["Lock", "Options", "acquire", "run"]
