"""The Python API: `Lock`, a named lock or semaphore slot held around a block (docs/api.md).

The CLI runs commands through `lockrun.runner`, which takes its slot with `acquire` here.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Final, ParamSpec, TypeVar

from lockrun.backends import (
    Backend,
    Holder,
    Request,
    open_backend,
    parse_uri,
)
from lockrun.bounds import (
    check_modes,
    check_slots,
    check_ttl,
    check_wait,
)
from lockrun.errors import (
    LeaseLost,
    LockBusy,
    TakenOver,
    UsageError,
)
from lockrun.lease_clock import Answer, LeaseClock, Verdict
from lockrun.names import check_name
from lockrun.timing import DEFAULT_TTL, clock_time, format_duration, now
from lockrun.uri import DEFAULT_URI

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from lockrun import backends

DEFAULT_NAMESPACE: Final = "default"
_P = ParamSpec("_P")
_R = TypeVar("_R")


def acquire(backend: Backend, request: Request, wait: float | None) -> backends.Lease:
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
    if holder.shared:
        text += " (shared)"
    if holder.until is not None:
        ran = "" if holder.since is None else f", which ran at {clock_time(holder.since)}"
        return f"{text}{ran}, until {clock_time(holder.until)} (--hold-at-least)"
    if holder.since is not None:
        text += f" since {clock_time(holder.since)}"
    if holder.detached:  # that pid is the acquire's, gone: the service keeps the lease
        until = "" if holder.expires is None else f" until {clock_time(holder.expires)}"
        text += f", a lease with no process{until} unless renewed (acquire --no-keeper)"
    return text


def _rung(bells: tuple[int, ...]) -> bool:
    """Whether any take-over bell is readable now (`backends.Lease.bells`)."""
    if not bells:
        return False
    import select  # noqa: PLC0415 - only leases with bells need it

    poll = select.poll()
    for fd in bells:
        poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class Lease:
    """A slot held through `Lock`: which one, its fence, and whether it is still ours.

    A lease of a server is renewed in the background while held; `check` raises
    `LeaseLost` as soon as a renewal found it gone (docs/api.md).
    """

    def __init__(self, lease: backends.Lease, key: tuple[str, str, str], hold: float = 0.0) -> None:
        """Wrap the backend's *lease* of the name *key* (URI, namespace, name).

        The slot stays taken until *hold* seconds after now, released or not (hold_at_least).
        """
        self._lease = lease
        self._key = key
        self._hold_until = now() + hold
        self.slot = lease.slot
        self.fence = lease.fence
        self.ttl = lease.ttl
        self.clock = LeaseClock(lease.ttl, lease.confirmed)  # docs/design.md A10
        self.lost: LeaseLost | None = None  # what a renewal found, if the lease is gone
        self.taken: TakenOver | None = None  # a take-over another acquirer asked for
        self.released = False
        self._renewal: _Renewal | None = None
        self._owner: list[tuple[str, str, str]] | None = None  # its thread's, for `Lock`
        self._pid = os.getpid()  # the process that holds it: a forked child is another

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is gone, released, or unconfirmed at its deadline.

        Raise `TakenOver` if another acquirer asked for a take-over: the slot is still ours
        until `release`, which the taker waits for.

        Cheap enough for every step of a loop: it asks no server, it reads what the
        renewals (every ttl/3) found, and a local lock's bell. A local lock is never lost,
        but once released it holds nothing either (docs/api.md).
        """
        if self.released and self.lost is None:
            msg = f"{self._key[2]}: released; this lease holds the lock no more"
            raise LeaseLost(msg)
        if self.taken is None and self.lost is None and _rung(self._lease.bells):
            # A renewal now: what it finds is kept, a lost lease too. A bell that is the
            # session's own socket (PostgreSQL's) also rings when the server hangs up.
            self.renew()
        if self.lost is not None:
            raise self.lost
        if self.taken is not None:
            raise self.taken
        if self.clock.verdict(now()) is Verdict.LOST:
            unconfirmed = format_duration(now() - self.clock.confirmed)
            msg = f"the lease was not confirmed for {unconfirmed}"
            raise LeaseLost(msg)

    def release(self) -> None:
        """Give the slot back; idempotent. Raise `LeaseLost` if it was lost while held."""
        if self.released:
            return
        self.released = True
        if self._owner is not None:  # from any thread: the acquiring one's list
            with contextlib.suppress(ValueError):
                self._owner.remove(self._key)
        try:
            if self._renewal is not None:
                self._renewal.cancel()
        finally:
            self._lease.release(hold=max(0.0, self._hold_until - now()))
        if self.lost is not None:
            raise self.lost

    @property
    def confirmed(self) -> float:
        """Return the `timing.now` of the request that last proved the lease ours."""
        return self.clock.confirmed

    def renew(self) -> float | None:
        """Prove the lease still ours; return seconds until the next renewal, None once lost.

        A renewal without an answer is a doubt, asked again after `lease_clock.RETRY`; the
        lease is lost once still unconfirmed at its deadline (docs/design.md A10).
        """
        doubt = self.confirm()
        if doubt is not None and self.clock.verdict(now()) is Verdict.LOST:
            self.lost = LeaseLost(f"lease could not be confirmed: {doubt}")
        if self.lost is not None:
            return None
        return max(0.0, self.clock.refresh_due() - now())

    def confirm(self) -> Exception | None:
        """Ask the service once whether the lease is ours; return why it did not say (None: it did).

        What it said is kept: a take-over asked for (`taken`), a lease gone (`lost`).
        """
        sent = now()
        self.clock.sending(sent)
        try:
            self._lease.refresh()
        except TakenOver as err:  # still ours, and proved so
            self.taken = err
            self.clock.answered(sent, Answer.TAKEN)
        except LeaseLost as err:
            self.lost = err
            self.clock.answered(sent, Answer.LOST)
        except Exception as err:  # noqa: BLE001 - unavailable, refused, a reply askew: a doubt
            self.clock.answered(sent, Answer.DOUBT, str(err))
            return err
        else:
            self.clock.answered(sent, Answer.HELD)
        return None


class Lock:
    """A named lock (or one slot of an N-slot semaphore) as context manager and decorator.

    ``with Lock("sales", slots=3, wait=60) as lease:`` holds a slot for the block;
    ``lease.slot`` and ``lease.fence`` say which slot and which fence token. ``wait`` is
    seconds, 0 (the default) tries once, None waits forever; a busy lock raises `LockBusy`.
    With ``reentrant=True`` the holding thread may acquire it again, nested (`acquire`).
    Each thread keeps its own connection to the service across acquisitions
    (docs/api.md "Connections"); `close` drops the calling thread's.
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
        shared: bool = False,
        hold_at_least: float = 0,
        take_over: bool = False,
        reentrant: bool = False,
    ) -> None:
        """Describe the lock; nothing is acquired yet. URI and namespace default as in the CLI.

        Bad values raise `UsageError` (numbers: see `lockrun.bounds`), a bad URI `ConfigError`.
        ``wait=math.inf`` waits forever, as None does. *shared*, *hold_at_least* and
        *take_over* are the CLI's --shared, --hold-at-least and --take-over (docs/api.md).
        *reentrant* lets a thread that holds this Lock acquire it again (`acquire`).
        """
        self.name = check_name(name)
        namespace = namespace or os.environ.get("LOCKRUN_NAMESPACE") or DEFAULT_NAMESPACE
        self.namespace = check_name(namespace, "namespace")
        self.uri = uri or os.environ.get("LOCKRUN_URI") or DEFAULT_URI
        self._uri = parse_uri(self.uri)  # a bad one is the caller's mistake: said now
        self.slots = check_slots(slots)
        self.wait = check_wait(wait)
        self.ttl = check_ttl(ttl)
        self.shared = shared
        self.hold_at_least = check_modes(
            self.slots,
            shared=shared,
            hold=hold_at_least,
            take_over=take_over,
            scheme=self._uri.scheme,
        )
        self.take_over = take_over
        self.reentrant = reentrant
        if take_over and self.wait == 0:
            msg = "take_over waits for the holders to stop: give it a wait"
            raise UsageError(msg)
        self._local = threading.local()  # per thread: its backend and `_holds`
        self._me = Holder.me(sys.argv)._replace(shared=shared)  # this process, as records say

    def acquire(self) -> Lease:
        """Take a slot, waiting as configured; raise `LockBusy` if none came free.

        A thread that holds this Lock already gets `UsageError` at once, unless the Lock is
        *reentrant*: then it gets the lease it holds, and only the release of its outermost
        acquisition gives the slot back. A thread that would wait for a mutex it holds
        through another Lock gets `UsageError` at once, reentrant or not.
        A lease of a server is renewed every ttl/3 until `release`.
        """
        key = (self.uri, self.namespace, self.name)
        holds = self._holds()
        if holds and not holds[-1].released:
            return self._reenter(holds)
        if not self.reentrant:
            holds.clear()  # a lease released by itself: nothing left to unwind
        if key in _HELD.keys and self.slots == 1 and self.wait != 0 and not self.shared:
            msg = f"{self.name}: this thread holds it already, through another Lock"
            raise UsageError(f"{msg}: it would wait for itself")
        backend = self._backend()
        held = Lease(acquire(backend, self._request(), self.wait), key, self.hold_at_least)
        try:
            start_renewals(held)
            held._owner = _HELD.keys  # noqa: SLF001 - the Lock and its Lease
            _HELD.keys.append(key)
            holds.append(held)
        except BaseException:  # e.g. Ctrl-C right after the grant: leave nothing held
            held.release()
            raise
        return held

    def _reenter(self, holds: list[Lease]) -> Lease:
        """Acquire what this thread holds again: nest if reentrant, else refuse."""
        held = holds[-1]
        if not self.reentrant:
            msg = f"{self.name}: this thread holds it already (a Lock is not reentrant)"
            raise UsageError(msg)
        parent = held._pid  # noqa: SLF001 - the Lock and its Lease
        if parent != os.getpid():
            # Another holder, whose descriptors and sessions a forked child shares: it can
            # neither nest on that hold nor wait for it (it would wait for itself on file:).
            msg = f"{self.name}: held by the process this one was forked from (pid {parent})"
            raise UsageError(f"{msg}; a forked child cannot nest on it")
        with contextlib.suppress(TakenOver):  # the slot is still ours: check() says it within
            held.check()  # a lease a renewal found gone is not taken again
        holds.append(held)
        return held

    def release(self) -> None:
        """Release the calling thread's slot; of a reentrant Lock, once its outermost hold ends.

        Raises `LeaseLost` if a renewal found the lease gone while it was held: the code
        under the lock may have overlapped with another holder's. An inner release of a
        reentrant Lock raises it too, and the outer ones again.
        """
        holds = self._holds()
        if not holds:
            msg = f"{self.name}: this thread holds no slot of this Lock"
            raise UsageError(msg)
        held = holds.pop()
        if held not in holds:
            held.release()
        elif held.lost is not None and not held.released:
            raise held.lost

    def _holds(self) -> list[Lease]:
        """Return the calling thread's acquisitions not yet released, outermost first.

        One entry per `acquire`: a reentrant Lock's nested ones repeat the outermost's lease.
        """
        holds: list[Lease] | None = getattr(self._local, "holds", None)
        if holds is None:
            holds = self._local.holds = []
        return holds

    def close(self) -> None:
        """Drop the calling thread's connection (it is made again on the next acquire)."""
        backend = self.__dict__.get("_local") and getattr(self._local, "backend", None)
        if backend is not None:
            self._local.backend = None
            backend.close()

    def _request(self) -> Request:
        """Say what to ask for, by this process from now (after a fork: the child)."""
        if self._me.pid != os.getpid():
            self._me = Holder.me(sys.argv)._replace(shared=self.shared)
        me = self._me  # not _replace, which costs the uncontended cycle a tenth (#32)
        holder = Holder._make((*me[:_SINCE], time.time(), *me[_SINCE + 1 :]))
        return Request(
            self.namespace,
            self.name,
            self.slots,
            self.ttl,
            holder,
            shared=self.shared,
            take_over=self.take_over,
            hold=self.hold_at_least,
        )

    def _backend(self) -> Backend:
        """Return the calling thread's backend, opened on its first use in this process."""
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            if getattr(local, "backend", None) is not None:  # the parent's, after a fork:
                _FORKED.append(local.backend)  # never closed here, which would end its sessions
            local.backend, local.pid = None, os.getpid()
        if local.backend is None:
            local.backend = open_backend(self._uri, ttl=self.ttl)
        backend: Backend = local.backend
        return backend

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


def start_renewals(held: Lease) -> None:
    """Renew *held* every ttl/3 from ttl/3 on, if it is a lease (a local lock is none)."""
    if held.ttl is not None:
        held._renewal = _RENEWALS.add(held)  # noqa: SLF001 - the Lease's own helper


class _Held(threading.local):
    """The names the calling thread holds through any Lock, as (URI, namespace, name)."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str, str]] = []  # once for each slot held


_HELD: Final = _Held()
_SINCE: Final = Holder._fields.index("since")
_FORKED: Final[list[Backend]] = []  # backends a forked child inherited: left alone


class _Renewal:
    """One lease's renewals: a thread of its own from the first renewal on, ttl/3 in.

    A block shorter than ttl/3 starts no thread at all: `_Renewals` only notes when the
    first renewal is due.
    """

    def __init__(self, held: Lease) -> None:
        self.held = held
        self.due = held.clock.refresh_due()  # counted from the request, as in supervise.py
        # Made by `start` (under _Renewals' lock, as `drop` is): a block shorter than ttl/3
        # makes neither it nor the thread.
        self.cancelled: threading.Event | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self.run, name="lockrun-renewer", daemon=True)
        self.thread.start()

    def run(self) -> None:
        every: float | None = max(0.0, self.due - now())
        assert self.cancelled is not None  # noqa: S101 - made before the thread starts
        while every is not None and not self.cancelled.wait(every):
            every = self.held.renew()

    def cancel(self) -> None:
        """Stop renewing; return once no renewal runs (so the lease may be released)."""
        _RENEWALS.drop(self)  # once dropped, never started: both under _Renewals' lock
        if self.cancelled is not None:
            self.cancelled.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()


class _Renewals:
    """Starts each lease's renewal thread when its first renewal is due: one waiting thread."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.pending: list[_Renewal] = []
        self.thread: threading.Thread | None = None
        # When the thread wakes by itself at the latest (`now`): a lease due no sooner needs
        # no wake-up, which would cost every acquisition a switch to that thread and back.
        self.wakes_at = math.inf

    def add(self, held: Lease) -> _Renewal:
        renewal = _Renewal(held)
        with self.changed:
            self.pending.append(renewal)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self.run, name="lockrun-renewals", daemon=True
                )
                self.thread.start()
            elif renewal.due < self.wakes_at:  # sooner than the thread waits for
                self.changed.notify()
        return renewal

    def drop(self, renewal: _Renewal) -> None:
        with self.changed:
            if renewal in self.pending:
                self.pending.remove(renewal)

    def run(self) -> None:
        with self.changed:
            while True:
                if not self.pending:
                    self.wakes_at = math.inf
                    self.changed.wait()
                    continue
                first = min(self.pending, key=lambda renewal: renewal.due)
                if first.due > now():
                    self.wakes_at = first.due
                    self.changed.wait(first.due - now())
                    continue
                self.pending.remove(first)
                first.start()

    def forget(self) -> None:
        """In a forked child: no thread runs yet, nothing is pending."""
        self.changed = threading.Condition()
        self.pending = []
        self.thread = None
        self.wakes_at = math.inf


_RENEWALS: Final = _Renewals()
os.register_at_fork(after_in_child=_RENEWALS.forget)


__all__ = ["Lease", "Lock", "acquire"]
