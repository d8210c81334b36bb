"""`AsyncLock`: the Python API for asyncio, on the same algorithms as `Lock` (docs/api.md).

Each acquisition waits in a thread of its own, on the backend code `Lock` uses, so the
event loop never blocks and no algorithm is written twice. Tasks are the holders: a task
that acquires what it holds gets `UsageError`, as a thread does with `Lock`, or nests if the
lock is reentrant. Cancelling a
task that waits ends its wait on a server at once (`interrupt`); a slot that comes in
after the cancel is given back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

from lockrun.backends import Request, open_backend, parse_uri
from lockrun.errors import TakenOver, UsageError
from lockrun.lock import Lease, Lock, acquire, start_renewals
from lockrun.timing import DEFAULT_TTL

if TYPE_CHECKING:
    from types import TracebackType

    from lockrun import backends
    from lockrun.backends import Backend


class AsyncLock:
    """A named lock (or one slot of an N-slot semaphore) for ``async with``.

    ``async with AsyncLock("sales", uri="redis://…", wait=60) as lease:`` holds a slot
    for the block; arguments, errors and leases are `Lock`'s.
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
        """Describe the lock; nothing is acquired yet. Bad values raise as `Lock`'s do.

        *reentrant* lets a task that holds it acquire it again, as a thread does a `Lock`'s.
        """
        self._lock = Lock(
            name,
            uri=uri,
            slots=slots,
            wait=wait,
            ttl=ttl,
            namespace=namespace,
            shared=shared,
            hold_at_least=hold_at_least,
            take_over=take_over,
            reentrant=reentrant,
        )
        self.name = self._lock.name
        self.reentrant = reentrant
        self._idle: list[Backend] = []  # connections no acquisition uses now
        # Per task, its acquisitions not yet released, outermost first: a reentrant lock's
        # nested ones repeat the outermost's lease.
        self._held: dict[asyncio.Task[object], list[tuple[Lease, Backend]]] = {}

    async def acquire(self) -> Lease:
        """Take a slot, waiting as configured without blocking the loop; `LockBusy` if none.

        A task that holds it gets the lease it holds if the lock is reentrant (only its
        outermost release gives the slot back), else `UsageError`, as `Lock.acquire`.
        """
        task = asyncio.current_task()
        if task is None:
            msg = f"{self.name}: an AsyncLock is held by a task; acquire it in one"
            raise UsageError(msg)
        holds = self._held.get(task, [])
        if holds and not self.reentrant:
            msg = f"{self.name}: this task holds it already (an AsyncLock is not reentrant)"
            raise UsageError(msg)
        if holds and not holds[-1][0].released:  # nested; a lease released by itself is not
            with contextlib.suppress(TakenOver):  # still ours: check() says it within
                holds[-1][0].check()  # a lease a renewal found gone is not taken again
            holds.append(holds[-1])
            return holds[-1][0]
        lock = self._lock
        request = lock._request()  # noqa: SLF001 - the Lock this one wraps: its process, once
        # A new connection is opened in the thread: a driver's first import takes 0.1 s.
        waiting = _Wait(asyncio.get_running_loop(), self._idle.pop() if self._idle else None)
        threading.Thread(
            target=waiting.run, args=(lock, request), name="lockrun-wait", daemon=True
        ).start()
        try:
            lease = await asyncio.shield(waiting.granted)
        except asyncio.CancelledError:
            waiting.cancel()
            raise
        except BaseException:
            if waiting.backend is not None:
                self._idle.append(waiting.backend)
            raise
        backend = waiting.backend
        assert backend is not None  # noqa: S101 - granted: the thread had one
        held = Lease(lease, (lock.uri, lock.namespace, lock.name), lock.hold_at_least)
        try:
            start_renewals(held)
        except BaseException:
            await asyncio.to_thread(held.release)
            raise
        self._held.setdefault(task, []).append((held, backend))
        return held

    async def release(self) -> None:
        """Release the calling task's slot (its outermost hold's); `LeaseLost` as `Lock`'s."""
        task = asyncio.current_task()
        holds = self._held.get(task, []) if task is not None else []
        if task is None or not holds:
            msg = f"{self.name}: this task holds no slot of this AsyncLock"
            raise UsageError(msg)
        held, backend = holds.pop()
        if not holds:
            del self._held[task]
        elif any(outer is held for outer, _ in holds):
            if held.lost is not None and not held.released:
                raise held.lost
            return
        release = asyncio.ensure_future(asyncio.to_thread(held.release))

        def done(_: object) -> None:  # a cancelled task's release still ends before reuse
            self._idle.append(backend)
            if not release.cancelled():
                release.exception()  # retrieved: the task may no longer be there to

        release.add_done_callback(done)
        await asyncio.shield(release)

    async def close(self) -> None:
        """Drop the connections no acquisition uses now."""
        idle, self._idle = self._idle, []
        for backend in idle:
            await asyncio.to_thread(backend.close)

    async def __aenter__(self) -> Lease:
        """Acquire and return the lease."""
        return await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Release."""
        await self.release()


class _Wait:
    """One acquisition's wait in a thread, and its hand-over to the loop (or its undoing)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, backend: Backend | None) -> None:
        self.loop = loop
        self.backend = backend
        self.granted: asyncio.Future[backends.Lease] = loop.create_future()
        self.settled = threading.Lock()  # the thread delivers, or the task cancels: not both
        self.cancelled = False
        self.delivered = False

    def run(self, lock: Lock, request: Request) -> None:
        """In the thread: wait for the slot, then hand it to the task, or give it back."""
        lease: backends.Lease | None = None
        error: BaseException | None = None
        try:
            if self.backend is None:
                self.backend = open_backend(parse_uri(lock.uri), ttl=lock.ttl)
            lease = acquire(self.backend, request, lock.wait)
        except BaseException as err:  # noqa: BLE001 - the task's to raise
            error = err
        with self.settled:
            if not self.cancelled:
                try:
                    self.loop.call_soon_threadsafe(self._deliver, lease, error)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass
                else:
                    self.delivered = True
                    return
        _undo(lease, self.backend)

    def _deliver(self, lease: backends.Lease | None, error: BaseException | None) -> None:
        """In the loop: hand the outcome to the task, or undo it if the task was cancelled."""
        if self.granted.cancelled() or self.cancelled:
            _undo(lease, self.backend, in_thread=True)
        elif error is not None:
            self.granted.set_exception(error)
        else:
            self.granted.set_result(lease)  # type: ignore[arg-type]  # no error: a lease

    def cancel(self) -> None:
        """In the loop: the task was cancelled; end the wait, give back what comes of it."""
        with self.settled:
            self.cancelled = True
            delivered = self.delivered
        if not delivered:
            interrupt = getattr(self.backend, "interrupt", None)  # where the backend can
            if interrupt is not None:
                interrupt()
        elif self.granted.done() and not self.granted.exception():
            _undo(self.granted.result(), self.backend, in_thread=True)


def _undo(
    lease: backends.Lease | None, backend: Backend | None, *, in_thread: bool = False
) -> None:
    """Release a slot nobody wants any more and close its connection (in a thread if asked)."""

    def undo() -> None:
        try:
            if lease is not None:
                lease.release()
        finally:
            if backend is not None:
                backend.close()

    if in_thread:
        threading.Thread(target=undo, name="lockrun-give-back", daemon=True).start()
    else:
        undo()


__all__ = ["AsyncLock"]
