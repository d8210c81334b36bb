"""One way to hold a lock: the request, the interruptible wait, its lines, and the release.

A run (`lockrun.runner`), `acquire`'s keeper (`lockrun.keeper`) and `acquire --no-keeper`
(`lockrun.detached`) differ only in what they do while they hold: supervise a command, serve
a door, or leave the lease to the service. How they ask, wait, report, say what they got and
give it back is written here, once.
"""

from __future__ import annotations

import contextlib
import signal
from typing import TYPE_CHECKING, Final

from lockrun.backends import Holder, Request
from lockrun.errors import BackendUnavailable, ConfigError, Interrupted, TakenOver
from lockrun.lock import acquire
from lockrun.progress import WaitReport
from lockrun.sigmask import pthread_sigmask
from lockrun.supervise import FORWARDED
from lockrun.timing import format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from types import FrameType

    from lockrun.backends import Backend, Lease
    from lockrun.runner import Options
    from lockrun.uri import LockURI

# While lockrun waits there is no command yet: these end the wait (exit 128+N, nothing held);
# USR1 and USR2 are noted under -v and dropped. Once the command runs, every signal of
# FORWARDED is the command's (supervise.py).
INTERRUPTS: Final = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})


def quiet(_line: str) -> None:
    """Say nothing: the log of a run without -v."""


def make_request(
    options: Options, namespace: str, name: str, holder: Sequence[str], lease_id: str = ""
) -> Request:
    """Return what *options* ask of (*namespace*, *name*), held by us as *holder* says."""
    return Request(
        namespace,
        name,
        options.slots,
        options.ttl,
        Holder.me(holder)._replace(shared=options.shared),
        shared=options.shared,
        take_over=options.take_over,
        hold=options.hold_at_least,
        lease_id=lease_id,
    )


def report_for(
    options: Options,
    request: Request,
    uri: LockURI,
    log: Callable[[str], None],
    live: Callable[[str], None] | None,
) -> WaitReport | None:
    """Return -v's report of a wait that may last (None: no -v, or one try)."""
    if not options.verbose or options.wait == 0:
        return None
    return WaitReport(request, uri, log=log, live=live)


def take(
    backend: Backend, request: Request, wait: float | None, report: WaitReport | None
) -> Lease:
    """Take *request*'s slot, with -v's report of the wait (*report*) if there is one.

    What it raises names the lock (docs/semantics.md "Exit status").
    """
    try:
        if report is not None:
            try:
                states = backend.status(request.namespace, request.name)
            except BackendUnavailable:  # only a report: acquire() judges the outage itself
                states = []
            report.start(states)
        return acquire(backend, request, wait)
    except BaseException as err:
        if report is not None:
            report.stop()
        if isinstance(err, BackendUnavailable | ConfigError | TakenOver):
            err.about(request.name)
        raise


def acquired(request: Request, lease: Lease, started: float) -> str:
    """Say which slot of *request* was taken, how long after *started*, and its fence."""
    fence = "" if lease.fence is None else f", fence {lease.fence}"
    return (
        f"acquired {request.name} slot {lease.slot} of {request.slots} "
        f"after {format_duration(now() - started)}{fence}"
    )


def release(
    lease: Lease, request: Request, held_since: float, hold: float, verbose: Callable[[str], None]
) -> bool:
    """Release *lease*, leaving it taken until *hold* seconds after *held_since*.

    Return whether the service heard it (`Lease.release`); -v says which.
    """
    took = now() - held_since
    hold -= took
    if not lease.release(hold=max(0.0, hold)):
        verbose(unheard(request.name, took))
        return False
    if hold > 0:
        verbose(f"left {request.name} taken for {format_duration(hold)} more (--hold-at-least)")
    verbose(f"released {request.name} after {format_duration(took)}")
    return True


def unheard(name: str, took: float) -> str:
    """Say that the release of *name*, held *took* seconds, never reached the service."""
    return (
        f"could not tell the server to release {name} after {format_duration(took)}; "
        'it frees by itself (docs/semantics.md "A killed holder")'
    )


class Waiting:
    """Whether we still wait for the lock, and which signals the caller had us ignore."""

    def __init__(self) -> None:
        """Start waiting, with no signal ignored yet."""
        self.over = False
        self.ignored: frozenset[int] = frozenset()  # nohup's HUP: never forwarded either


@contextlib.contextmanager
def interruptible(name: str, log: Callable[[str], None]) -> Iterator[Waiting]:
    """Turn INT, TERM, HUP and QUIT into `Interrupted`: waits unwind and release what they hold."""
    waiting = Waiting()

    def interrupt(signo: int, _frame: FrameType | None) -> None:
        if waiting.over:  # after the command: its status stands, lockrun is leaving anyway
            return
        what = signal.Signals(signo).name
        if signo not in INTERRUPTS:
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
def deferred(signals: frozenset[signal.Signals]) -> Iterator[None]:
    """Block *signals* for the block; drop those that arrived unclaimed before unblocking."""
    saved = pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        while signal.sigtimedwait(signals, 0) is not None:
            pass
        pthread_sigmask(signal.SIG_SETMASK, saved)


__all__ = [
    "INTERRUPTS",
    "Waiting",
    "acquired",
    "deferred",
    "interruptible",
    "make_request",
    "quiet",
    "release",
    "report_for",
    "take",
    "unheard",
]
