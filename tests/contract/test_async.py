"""`AsyncLock` on every backend: it excludes, it never blocks the loop, a cancel leaves nothing.

The oracle is outside the lock's word: the CLI's exit status, `lockrun status`, and a ticker
task that counts how often the loop got to run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import AsyncLock, ExitCode, Lock, LockBusy, UsageError
from lockrun.errors import LeaseLost
from lockrun.uri import parse_uri
from tests.contract.test_lock import PATIENCE, HolderThread
from tests.support.cli import lock_state, lockrun

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from tests.support.harness import Harness

TICK = 0.01


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run *main* on a new event loop, as an application would."""
    asyncio.run(main())  # type: ignore[arg-type]


async def ticks_during(work: Awaitable[object]) -> tuple[object, int]:
    """Await *work* while a task counts how often the loop gets to run it every TICK s."""
    count = 0

    async def tick() -> None:
        nonlocal count
        while True:
            await asyncio.sleep(TICK)
            count += 1

    ticker = asyncio.create_task(tick())
    try:
        return await work, count
    finally:
        ticker.cancel()


def test_async_lock_holds_and_excludes(uri: str, name: str) -> None:
    """`async with` holds the lock: the CLI and another AsyncLock find it busy; then free."""

    async def main() -> None:
        async with AsyncLock(name, uri=uri) as lease:
            assert lease.slot == 0
            lease.check()
            cli = await asyncio.to_thread(lockrun, "--uri", uri, "-n", name, "--", "true")
            assert cli.returncode == ExitCode.BUSY
            with pytest.raises(LockBusy):
                async with AsyncLock(name, uri=uri):
                    pass
        with pytest.raises(LeaseLost, match="released"):  # the block is over: held no more
            lease.check()
        again = AsyncLock(name, uri=uri)
        async with again as lease:
            assert lease.slot == 0
        await again.close()

    run(main)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


def test_a_waiting_async_lock_never_blocks_the_loop(uri: str, name: str) -> None:
    """While a task waits for the lock, the loop runs other tasks; the wait ends with the grant."""
    holder = Lock(name, uri=uri)
    holder.acquire()

    async def main() -> None:
        lock = AsyncLock(name, uri=uri, wait=30)
        loop = asyncio.get_running_loop()
        loop.call_later(1.0, holder.release)  # in the loop's thread, as the lock was taken
        started = time.monotonic()
        lease, count = await ticks_during(lock.acquire())
        waited = time.monotonic() - started
        assert waited >= 0.9
        assert count >= waited / TICK / 4, (count, waited)  # the loop ran all along
        assert lease.slot == 0  # type: ignore[attr-defined]
        await lock.release()

    run(main)


def test_tasks_of_one_async_lock_take_turns_and_may_not_reenter(uri: str, name: str) -> None:
    """Two tasks on one AsyncLock hold it one after the other; a task that holds it is refused."""
    lock = AsyncLock(name, uri=uri, wait=30)
    inside: list[str] = []
    overlaps = 0

    async def work(who: str) -> None:
        nonlocal overlaps
        async with lock:
            overlaps += bool(inside)
            inside.append(who)
            with pytest.raises(UsageError, match="not reentrant"):
                await lock.acquire()
            await asyncio.sleep(0.2)
            inside.remove(who)

    async def main() -> None:
        await asyncio.gather(work("a"), work("b"), work("c"))
        await lock.close()

    run(main)
    assert overlaps == 0


def test_a_cancelled_wait_leaves_nothing_behind(uri: str, name: str) -> None:
    """Cancelling a waiting task frees its place: once the holder leaves, the lock is free.

    A server's queue loses the waiter at once (the wait is interrupted); a local waiter,
    whose flock(2) nothing can interrupt, takes the slot when it comes and gives it back.
    """
    holder = Lock(name, uri=uri)
    holder.acquire()

    async def main() -> None:
        # An hour's ttl: a place that lapsed rather than left would outlast the checks below.
        waiter = asyncio.create_task(AsyncLock(name, uri=uri, wait=None, ttl=3600).acquire())
        await asyncio.sleep(0.5)  # queued by now
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    run(main)
    if not parse_uri(uri).kind.local:  # a server's queue: the place is gone before any grant
        deadline = time.monotonic() + 60  # a hang guard: `status` runs are start-ups
        while lock_state(uri, name)["waiters"]:
            assert time.monotonic() < deadline, lock_state(uri, name)
            time.sleep(0.05)
    holder.release()
    deadline = time.monotonic() + 60  # a hang guard, as above
    while lock_state(uri, name)["holders"] or lock_state(uri, name)["waiters"]:
        assert time.monotonic() < deadline, lock_state(uri, name)
        time.sleep(0.05)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


def test_an_async_timed_wait_leaves_the_applications_timer_alone(uri: str, name: str) -> None:
    """AsyncLock(wait=…): the loop's SIGALRM handler runs when the application's timer fires."""
    holder = HolderThread(uri, name)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGALRM, holder.go.set)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            async with AsyncLock(name, uri=uri, wait=PATIENCE) as lease:  # hang guard: busy
                assert lease.slot == 0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            loop.remove_signal_handler(signal.SIGALRM)

    previous = signal.getsignal(signal.SIGALRM)
    before = signal.getitimer(signal.ITIMER_REAL)
    try:
        run(main)
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *before)
        holder.finish()


def test_a_reentrant_async_lock_nests_per_task(uri: str, name: str) -> None:
    """A task re-entering a reentrant AsyncLock nests: only its outermost exit frees the lock.

    Another process finds it busy at depth 2 and after the inner exit; a task the holder
    starts is another holder (busy), and may not release what it does not hold.
    """

    async def busy() -> bool:
        cli = await asyncio.to_thread(lockrun, "--uri", uri, "-n", name, "--", "true")
        return cli.returncode == ExitCode.BUSY

    async def main() -> None:
        lock = AsyncLock(name, uri=uri, reentrant=True)
        async with lock as outer:
            async with lock as inner:
                assert inner is outer
                assert await busy()
                with pytest.raises(LockBusy):
                    await asyncio.create_task(lock.acquire())
                with pytest.raises(UsageError, match="holds no slot"):
                    await asyncio.create_task(lock.release())
            assert await busy()
            outer.check()
        with pytest.raises(LeaseLost, match="released"):
            outer.check()
        with pytest.raises(UsageError, match="holds no slot"):
            await lock.release()
        async with lock as again:
            assert again is not outer
        await lock.close()

    run(main)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


def test_a_reentrant_async_lock_reports_a_lost_lease_at_every_level(
    shared_server_harness: Harness, name: str
) -> None:
    """A lease lost while a task nests: re-entering raises LeaseLost, and so does each exit."""
    uri = shared_server_harness.uri

    async def main() -> None:
        lock = AsyncLock(name, uri=uri, ttl=1.5, reentrant=True)
        lease = await lock.acquire()
        assert await lock.acquire() is lease
        await asyncio.to_thread(shared_server_harness.end_session, name)
        deadline = time.monotonic() + 10  # a hang guard: a renewal finds it within ttl/3
        while True:
            try:
                lease.check()
            except LeaseLost:
                break
            assert time.monotonic() < deadline, "check() never reported the lost lease"
            await asyncio.sleep(0.05)
        with pytest.raises(LeaseLost):
            await lock.acquire()
        with pytest.raises(LeaseLost):
            await lock.release()
        with pytest.raises(LeaseLost):
            await lock.release()
        await lock.close()

    run(main)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0
