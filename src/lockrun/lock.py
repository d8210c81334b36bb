"""The Python API: `Lock`, a named lock or semaphore slot held around a block (docs/api.md).

The CLI runs commands through `lockrun.runner`, which takes its slot with `acquire` here.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Final, ParamSpec, TypeVar

from lockrun.backends import (
    Backend,
    Holder,
    Lease,
    Request,
    open_backend,
    parse_uri,
)
from lockrun.bounds import (
    check_slots,
    check_ttl,
    check_wait,
)
from lockrun.errors import (
    LeaseLost,
    LockBusy,
)
from lockrun.names import check_name
from lockrun.timing import clock_time, format_duration, now
from lockrun.uri import DEFAULT_URI

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

DEFAULT_NAMESPACE: Final = "default"
DEFAULT_TTL: Final = 30.0
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


__all__ = ["Lock", "acquire"]
