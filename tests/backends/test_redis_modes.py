"""The fleet modes as Redis keeps them: readers, windows, take-over requests and the bell.

tests/contract/test_modes.py holds what every backend must do; here is what only the Redis
scripts do (docs/design.md A4, docs/backends.md "Redis"), checked against the keys and
the server's own clock. Every server is a real redis-server.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import TYPE_CHECKING

import pytest
import redis

from lockrun import ExitCode, TakenOver
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.redis import SHARED, RedisBackend, RedisLease, key_prefix
from lockrun.backends.redis.scripts import RELEASE, RENEW
from lockrun.bounds import MAX_WAIT
from lockrun.errors import ConfigError
from lockrun.timing import now
from tests.support.cli import lockrun, one_line, start, wait_for

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.servers import RedisServer

TTL = 5.0
# A hang guard: each wait below ends as soon as its event comes; a loaded machine only delays it.
PATIENCE = 60.0
HOUR = 3600.0  # a lease or window no test outlives: whatever comes sooner is not its doing


@pytest.fixture
def keys(redis_uri: str) -> Iterator[redis.Redis]:
    """Return a client of the session's Redis, to read a lock's keys."""
    client = redis.Redis.from_url(redis_uri, decode_responses=True)
    yield client
    client.close()


def connect(uri: str, ttl: float = TTL) -> RedisBackend:
    """Return a Redis backend for *uri*."""
    backend = open_backend(parse_uri(uri), ttl=ttl)
    assert isinstance(backend, RedisBackend)
    return backend


@pytest.fixture
def backends(redis_uri: str) -> Iterator[Callable[..., RedisBackend]]:
    """Return a factory of backends on the session's Redis, all closed at teardown."""
    made: list[RedisBackend] = []

    def factory(ttl: float = TTL) -> RedisBackend:
        backend = connect(redis_uri, ttl)
        made.append(backend)
        return backend

    yield factory
    for backend in made:
        backend.close()


def ask(name: str, *, shared: bool = False, take_over: bool = False, slots: int = 1) -> Request:
    """Return a request for *name* by this process."""
    holder = Holder.me(["test"])._replace(shared=shared)
    return Request("default", name, slots, TTL, holder, shared=shared, take_over=take_over)


def held(backend: RedisBackend, request: Request, wait: float | None = 0) -> RedisLease:
    """Acquire *request* (waiting up to *wait* seconds) and return the lease."""
    lease = backend.acquire(request, None if wait is None else now() + wait)
    assert lease is not None, f"{request.name} busy"
    return lease


def server_ms(client: redis.Redis) -> int:
    """Return the server's clock in ms."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


class Waiting(threading.Thread):
    """An acquire in a thread of its own: `lease` once granted, or what it raised."""

    def __init__(self, backend: RedisBackend, request: Request, wait: float | None = 30) -> None:
        """Start waiting for *request*."""
        super().__init__(daemon=True)
        self.backend, self.request, self.wait = backend, request, wait
        self.lease: RedisLease | None = None
        self.error: BaseException | None = None
        self.granted = threading.Event()
        self.start()

    def run(self) -> None:
        """Acquire, note the outcome."""
        try:
            self.lease = self.backend.acquire(
                self.request, None if self.wait is None else now() + self.wait
            )
        except BaseException as err:  # noqa: BLE001 - the test asserts on it
            self.error = err
        self.granted.set()


def queued(uri: str, name: str, count: int) -> None:
    """Wait until *count* waiters queue for *name*."""
    backend = open_backend(parse_uri(uri), ttl=TTL)
    try:
        wait_for(
            lambda: sum(len(state.waiters) for state in backend.status("default", name)) == count,
            what=f"{count} waiters",
        )
    finally:
        backend.close()


# -- --shared ---------------------------------------------------------------------------------


def test_readers_draw_no_fence_and_writers_fences_keep_rising(
    backends: Callable[..., RedisBackend], keys: redis.Redis, name: str
) -> None:
    """Readers hold with fence None and leave the counter alone; the next writer's is larger."""
    backend = backends()
    first = held(backend, ask(name))
    first.release()
    fence = f"{key_prefix('default', name)}:fence"
    counter = keys.get(fence)
    readers = [held(backends(), ask(name, shared=True)) for _ in range(3)]
    assert [reader.fence for reader in readers] == [None, None, None]
    assert [reader.bells for reader in readers] == [(), (), ()]  # a lone holder's only
    assert all(reader.claim.token.startswith(SHARED) for reader in readers)
    assert keys.get(fence) == counter
    for reader in readers:
        reader.release()
    second = held(backend, ask(name))
    assert first.fence is not None
    assert second.fence is not None
    assert second.fence > first.fence
    second.release()


def test_a_readers_command_has_no_lockrun_fence(redis_uri: str, name: str) -> None:
    """LOCKRUN_FENCE is unset for a --shared run (a fence orders writers), set for a writer."""
    show = ("--", "sh", "-c", 'echo "${LOCKRUN_FENCE-unset} $LOCKRUN_SLOT"')
    reader = lockrun("--uri", redis_uri, "-n", name, "--shared", *show)
    writer = lockrun("--uri", redis_uri, "-n", name, *show)
    assert (reader.returncode, reader.stdout.split()) == (0, ["unset", "0"]), reader.stderr
    assert writer.returncode == 0, writer.stderr
    assert writer.stdout.split()[0].isdigit()


def test_consecutive_readers_at_the_head_enter_together_and_no_further(
    backends: Callable[..., RedisBackend], redis_uri: str, name: str
) -> None:
    """Queue R1 R2 W R3 behind a writer: its release grants R1 and R2; W, then R3, follow."""
    writer = held(backends(), ask(name))
    order = [("r1", True), ("r2", True), ("w", False), ("r3", True)]
    waiting: dict[str, Waiting] = {}
    for count, (tag, shared) in enumerate(order, 1):
        waiting[tag] = Waiting(backends(), ask(name, shared=shared))
        queued(redis_uri, name, count)
    writer.release()
    for tag in ("r1", "r2"):
        assert waiting[tag].granted.wait(10), f"{tag} was not let in"
    time.sleep(0.3)  # W and R3 would have been granted by now
    assert not waiting["w"].granted.is_set()
    assert not waiting["r3"].granted.is_set()
    state = open_backend(parse_uri(redis_uri), ttl=TTL)
    try:
        (lock,) = state.status("default", name)
    finally:
        state.close()
    assert [holder.shared for holder in lock.holders] == [True, True]
    assert [waiter.shared for waiter in lock.waiters] == [False, True]
    for tag in ("r1", "r2"):
        lease = waiting[tag].lease
        assert lease is not None
        lease.release()
    assert waiting["w"].granted.wait(10)
    assert not waiting["r3"].granted.wait(0.3), "R3 overtook W"
    lease = waiting["w"].lease
    assert lease is not None
    lease.release()
    assert waiting["r3"].granted.wait(10)
    assert waiting["r3"].lease is not None
    waiting["r3"].lease.release()


def test_readers_and_users_of_other_slots_refuse_each_other(
    backends: Callable[..., RedisBackend], redis_uri: str, name: str
) -> None:
    """A reader (one slot) meets users of three slots, and back: 78 both ways."""
    three = held(backends(), ask(name, slots=3))
    with pytest.raises(ConfigError, match="1 slot"):
        backends().acquire(ask(name, shared=True), None)
    three.release()
    reader = held(backends(), ask(name, shared=True))
    result = lockrun("--uri", redis_uri, "-n", name, "--slots", "3", "--", "true")
    assert result.returncode == ExitCode.CONFIG
    assert "1 slot" in one_line(result.stderr)
    reader.release()


# -- --hold-at-least ----------------------------------------------------------------------------


def test_a_window_runs_on_the_servers_clock_and_shows_as_until(
    backends: Callable[..., RedisBackend], keys: redis.Redis, name: str
) -> None:
    """release(hold=3): the lease's expiry is the server's now + 3 s, owners and status say so."""
    backend = backends()
    lease = held(backend, ask(name))
    before = server_ms(keys)
    lease.release(hold=3.0)
    after = server_ms(keys)
    prefix = key_prefix("default", name)
    ends = keys.zscore(f"{prefix}:holders", lease.claim.token)
    assert ends is not None
    assert before + 3000 <= ends <= after + 3000
    assert str(keys.hget(f"{prefix}:owners", lease.claim.token)).endswith(f" {int(ends)}")
    assert keys.pttl(f"{prefix}:owners") >= 3000  # the keys outlive the window
    (state,) = backend.status("default", name)
    (holder,) = state.holders
    assert holder.until == holder.expires == ends / 1000
    assert holder.pid == os.getpid()
    assert backend.acquire(ask(name), 0) is None
    later = held(backend, ask(name), wait=3 + PATIENCE)
    assert server_ms(keys) >= ends
    later.release()


def test_a_window_takes_no_renewal_and_a_retried_release_keeps_it(
    backends: Callable[..., RedisBackend], keys: redis.Redis, name: str
) -> None:
    """A renewal after the held release revives nothing (0); the release asked again is a no-op."""
    backend = backends()
    lease = held(backend, ask(name))
    lease.release(hold=2.0)
    holders = f"{key_prefix('default', name)}:holders"
    ends = keys.zscore(holders, lease.claim.token)
    assert backend.call(RENEW, lease.claim) is None  # lost
    assert backend.call(RELEASE, lease.claim, 60_000) == ()  # D3: the same release again
    assert keys.zscore(holders, lease.claim.token) == ends


def test_a_waiter_whose_wait_ends_inside_a_window_is_busy_at_once(
    backends: Callable[..., RedisBackend], name: str
) -> None:
    """A window of an hour and a wait of a minute: None at once, not after the minute."""
    held(backends(), ask(name)).release(hold=HOUR)
    began = now()
    assert backends().acquire(ask(name), now() + 60) is None
    assert now() - began < 60  # one that waited its wait out returns at 60 s, not before


def test_a_queued_waiter_is_woken_to_sleep_until_the_window_ends(
    backends: Callable[..., RedisBackend], redis_uri: str, name: str
) -> None:
    """Queued before a release with a short hold: it runs as the window ends, not a ttl/2 later."""
    lease = held(backends(ttl=HOUR), ask(name)._replace(ttl=HOUR))
    # It asks again every 30 min, long after its 30 s wait: granted at all, it was woken.
    waiter = Waiting(backends(ttl=HOUR), ask(name)._replace(ttl=HOUR))
    queued(redis_uri, name, 1)
    released = now()
    lease.release(hold=1.0)
    assert waiter.granted.wait(PATIENCE)
    assert now() - released >= 1.0 - 0.05
    assert waiter.lease is not None
    waiter.lease.release()


def test_a_year_long_window_keeps_the_keys_that_long(
    backends: Callable[..., RedisBackend], keys: redis.Redis, name: str
) -> None:
    """The keys live a minute past the window, up to the longest window (366 days)."""
    lease = held(backends(), ask(name))
    lease.release(hold=MAX_WAIT + 86400)  # more than the longest: cut to it
    prefix = key_prefix("default", name)
    try:
        lived = keys.pttl(f"{prefix}:holders")
        assert MAX_WAIT * 1000 - 10_000 < lived <= MAX_WAIT * 1000 + 60_000
        ends = keys.zscore(f"{prefix}:holders", lease.claim.token)
        assert ends is not None
        assert ends <= server_ms(keys) + MAX_WAIT * 1000
    finally:
        keys.delete(*keys.keys(f"{prefix}:*"))


# -- --take-over -----------------------------------------------------------------------------------


def readable(fd: int, timeout: float) -> bool:
    """Return whether *fd* turns readable within *timeout* seconds."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(timeout * 1000))


def test_a_take_over_rings_the_holders_bell_and_the_lease_stays_ours_until_released(
    backends: Callable[..., RedisBackend], keys: redis.Redis, redis_uri: str, name: str
) -> None:
    """With a 30 s lease, the bell rings (no renewal runs); refresh extends, then says TakenOver."""
    lease = held(backends(ttl=30), ask(name)._replace(ttl=30.0))
    (bell,) = lease.bells
    assert not readable(bell, 0.2)
    taker = Waiting(backends(), ask(name, take_over=True))
    began = now()
    assert readable(bell, PATIENCE), "the bell did not ring"
    rang = now() - began
    print(f"take-over: bell after {rang * 1000:.0f} ms")  # the report's notice time
    holders = f"{key_prefix('default', name)}:holders"
    before = keys.zscore(holders, lease.claim.token)
    with pytest.raises(TakenOver, match=f"taken over by .* pid {os.getpid()}"):
        lease.refresh()
    assert keys.zscore(holders, lease.claim.token) >= before  # type: ignore[operator]
    assert not readable(bell, 0), "the renewal did not hear the bell"
    assert not taker.granted.wait(0.3), "the taker got in before the holder released"
    lease.release()
    assert taker.granted.wait(PATIENCE)
    assert taker.lease is not None
    taker.lease.release()
    assert "lockrun-redis-bell" not in {thread.name for thread in threading.enumerate()}
    queued(redis_uri, name, 0)


def test_a_release_during_a_take_over_leaves_no_window(
    backends: Callable[..., RedisBackend], name: str
) -> None:
    """A holder told to stop releases with a hold: the taker gets in at once all the same."""
    lease = held(backends(), ask(name))
    taker = Waiting(backends(), ask(name, take_over=True))
    wait_for(lambda: _taken(lease), what="the take-over request")
    lease.release(hold=HOUR)  # a taker that waited it out would give up (None) after 30 s
    assert taker.granted.wait(PATIENCE)
    assert taker.lease is not None
    taker.lease.release()


def _taken(lease: RedisLease) -> bool:
    try:
        lease.refresh()
    except TakenOver:
        return True
    return False


def test_a_waiter_granted_during_a_take_over_gives_way_in_acquire(
    backends: Callable[..., RedisBackend], redis_uri: str, name: str
) -> None:
    """Holder, waiter, taker: the waiter's acquire raises TakenOver; it never held the slot."""
    lease = held(backends(), ask(name))
    ahead = Waiting(backends(), ask(name))
    queued(redis_uri, name, 1)
    taker = Waiting(backends(), ask(name, take_over=True))
    queued(redis_uri, name, 2)
    lease.release()
    assert ahead.granted.wait(PATIENCE)
    assert isinstance(ahead.error, TakenOver), ahead.error
    assert f"pid {os.getpid()}" in str(ahead.error)
    assert taker.granted.wait(PATIENCE)
    assert taker.lease is not None
    taker.lease.release()


def test_the_stop_request_lives_no_longer_than_the_takers_place(
    backends: Callable[..., RedisBackend], redis_uri: str, keys: redis.Redis, name: str
) -> None:
    """A taker with --ttl 2 killed: its stop key expires within 2 s, and stops nobody after."""
    lease = held(backends(ttl=30), ask(name)._replace(ttl=30.0))
    stop = f"{key_prefix('default', name)}:stop"
    taker = start(
        "--uri", redis_uri, "-n", name, "--ttl", "2", "--take-over", "-w", "60", "--", "true"
    )
    try:
        wait_for(lambda: keys.exists(stop), what="the take-over request")
        assert 0 < keys.pttl(stop) <= 2000
        with pytest.raises(TakenOver):
            lease.refresh()
    finally:
        taker.kill()
        taker.communicate()
    wait_for(lambda: not keys.exists(stop), timeout=2 + PATIENCE, what="the request to lapse")
    lease.refresh()  # no longer asked to stop
    lease.release()
    later = held(backends(), ask(name))
    later.refresh()
    later.release()


def test_a_lease_without_a_bell_still_sees_a_take_over_at_its_renewal(
    redis_server: RedisServer, name: str
) -> None:
    """A Redis user refused CLIENT (an ACL): no bell, and refresh still raises TakenOver."""
    redis_server.command("ACL", "SETUSER", "plain", "on", ">pw", "~*", "&*", "+@all", "-client")
    uri = f"{redis_server.uri}?username=plain&password=pw"
    backend, taking = connect(uri), connect(uri)
    try:
        lease = backend.acquire(ask(name), 0)
        assert isinstance(lease, RedisLease)
        assert lease.bells == ()
        taker = Waiting(taking, ask(name, take_over=True))
        wait_for(lambda: _taken(lease), what="the renewal to see the take-over")
        lease.release()
        assert taker.granted.wait(PATIENCE)
        assert taker.lease is not None
        taker.lease.release()
    finally:
        backend.close()
        taking.close()


def test_a_lease_with_a_bell_leaves_nothing_tracked(redis_server: RedisServer, name: str) -> None:
    """After release: no connection tracks, and Redis's tracking table is empty again."""
    backend = open_backend(parse_uri(redis_server.uri), ttl=TTL)
    try:
        for _ in range(3):
            lease = backend.acquire(ask(name), 0)
            assert lease is not None
            assert lease.bells
            lease.refresh()
            lease.release()
        stats = redis_server.command("INFO", "stats")
        clients = redis_server.command("CLIENT", "LIST")
    finally:
        backend.close()
    assert "tracking_total_items:0" in stats
    assert not [line for line in clients.splitlines() if "flags=t" in line]


def test_a_flushed_server_rings_the_bell(redis_server: RedisServer, name: str) -> None:
    """FLUSHALL pushes to every tracking connection: the lease finds out in a renewal now."""
    backend = open_backend(parse_uri(redis_server.uri), ttl=30)
    try:
        lease = backend.acquire(ask(name), 0)
        assert lease is not None
        (bell,) = lease.bells
        redis_server.command("FLUSHALL")
        assert readable(bell, PATIENCE)
        with pytest.raises(Exception, match="gone"):
            lease.refresh()
        lease.release()
    finally:
        backend.close()


def test_a_bell_listens_again_after_its_connection_was_cut(
    redis_server: RedisServer, name: str
) -> None:
    """CLIENT KILL of the lease's connection: the next renewal reconnects and the bell rings."""
    backend, taking = connect(redis_server.uri, 30), connect(redis_server.uri, 30)
    try:
        lease = backend.acquire(ask(name), 0)
        assert isinstance(lease, RedisLease)
        (bell,) = lease.bells
        redis_server.command("CLIENT", "KILL", "TYPE", "normal")
        assert readable(bell, PATIENCE)  # the hang-up rings too
        lease.refresh()  # on a new connection, tracked again
        assert not readable(bell, 0.2)
        taker = Waiting(taking, ask(name, take_over=True))
        assert readable(bell, PATIENCE)
        with pytest.raises(TakenOver):
            lease.refresh()
        lease.release()
        assert taker.granted.wait(PATIENCE)
        assert taker.lease is not None
        taker.lease.release()
    finally:
        backend.close()
        taking.close()
