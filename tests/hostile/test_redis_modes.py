"""The modes' keys and fields as another client of the same Redis may write them.

A co-tenant can write a lock's stop key, a window's end, a reader's token or an owners
entry with any suffix. Whatever they write: no traceback, no exit 70, one line; a forged
window or holder may make the lock busy (the power of holding it) but is read back no
later than the longest window, and a forged stop request stops nobody unless it names a
waiter that keeps its place (docs/design.md A4).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockrun import ExitCode
from lockrun.backends import Holder, Lease, Request, open_backend, parse_uri
from lockrun.backends.redis import key_prefix
from lockrun.bounds import MAX_WAIT
from lockrun.cli.output import status_text
from lockrun.errors import LeaseLost, LockBusy, TakenOver
from lockrun.lock import acquire
from lockrun.timing import now
from tests.support.cli import lock_state, lockrun, one_line
from tests.support.strategies import holder_like

if TYPE_CHECKING:
    from collections.abc import Iterator

YEAR_3000_MS = 32503680000000


@pytest.fixture
def co_tenant(redis_uri: str) -> Iterator[redis.Redis]:
    """Return a client of the session's Redis: the co-tenant's."""
    client = redis.Redis.from_url(redis_uri, decode_responses=True)
    yield client
    client.close()


def clean(result: object, *statuses: int) -> None:
    """Assert a run ended with one of *statuses*, one line if lockrun's, and no traceback."""
    status, err = result.returncode, result.stderr  # type: ignore[attr-defined]
    assert status in statuses, (status, err)
    assert "Traceback" not in err
    if status != 0:
        one_line(err)


def statuses_read(uri: str, name: str) -> None:
    """Assert `lockrun status` reads the lock, in text and JSON."""
    for args in ([name], ["--json", name], ["--json"]):
        shown = lockrun("status", "--uri", uri, *args)
        assert (shown.returncode, shown.stderr) == (0, ""), shown.stderr


STOP_PLANTS: dict[str, tuple[str, str | dict[str, str]]] = {
    "garbage": ("set", "x"),
    "empty": ("set", ""),
    "names-no-waiter": ("set", 'nobody {"host": "h", "pid": 1, "user": "u"}'),
    "huge": ("set", "t " + "x" * 1_000_000),
    "a-hash": ("hset", {"token": "t"}),
    "a-list": ("rpush", "t r"),
}


@contextlib.contextmanager
def planted_stop(redis_uri: str, co_tenant: redis.Redis, name: str, plant: str) -> Iterator[Lease]:
    """Hold *name* with a lease nothing renews, its bell armed, and plant a stop key under it.

    Yield the lease once a refresh has shown it not stopped; closed at the end.
    """
    stop = f"{key_prefix('default', name)}:stop"
    kind, value = STOP_PLANTS[plant]
    # A lease nothing renews: long enough to outlast a lockrun start-up at load 30.
    backend = open_backend(parse_uri(redis_uri), ttl=600)
    try:
        lease = backend.acquire(Request("default", name, 1, 600.0, Holder.me(["x"])), 0)
        assert lease is not None
        lease.bells  # noqa: B018 - arms the bell, which reads the key
        co_tenant.delete(stop)
        if isinstance(value, dict):
            co_tenant.hset(stop, mapping=value)  # type: ignore[arg-type]
        elif kind == "rpush":
            co_tenant.rpush(stop, value)
        else:
            co_tenant.set(stop, value)
        lease.refresh()  # not stopped
        yield lease
    finally:
        backend.close()
        co_tenant.delete(stop)


# Each plant is read by the bell, the renewal and the take-over's script: in this process, on
# the session's Redis, with what `lockrun status` prints of the lock. The command line once,
# below.
@pytest.mark.parametrize("plant", sorted(STOP_PLANTS))
def test_a_forged_stop_key_stops_nobody(
    redis_uri: str, co_tenant: redis.Redis, name: str, plant: str
) -> None:
    """Any stop key that names no waiter: the holder renews on, a take-over still works."""
    with planted_stop(redis_uri, co_tenant, name, plant) as lease:
        taker = open_backend(parse_uri(redis_uri), ttl=5.0)
        try:
            for states in (taker.status("default", name), taker.status("default", None)):
                for as_json in (False, True):
                    status_text(states, as_json=as_json, empty="default")
            request = Request("default", name, 1, 5.0, Holder.me(["y"]), take_over=True)
            with pytest.raises(LockBusy):  # the holder has not given way: 75
                acquire(taker, request, 0.5)
            lease.release()
            acquire(taker, request, 5).release()
        finally:
            taker.close()


def test_a_forged_stop_key_stops_nobody_on_the_command_line(
    redis_uri: str, co_tenant: redis.Redis, name: str
) -> None:
    """The same through `lockrun --take-over` and `lockrun status`: 75 in one line, then 0."""
    with planted_stop(redis_uri, co_tenant, name, "names-no-waiter") as lease:
        statuses_read(redis_uri, name)
        busy = lockrun("--uri", redis_uri, "-n", name, "--take-over", "-w", "0.5", "--", "true")
        clean(busy, ExitCode.BUSY)
        lease.release()
        result = lockrun("--uri", redis_uri, "-n", name, "--take-over", "-w", "5", "--", "true")
        clean(result, 0)


def forge_holder(client: redis.Redis, name: str, token: str, owner: str, ends_ms: float) -> None:
    """Write a holder *token* of *name* the scripts would read, with *owner* in owners."""
    prefix = key_prefix("default", name)
    client.zadd(f"{prefix}:holders", {token: ends_ms})
    client.hset(f"{prefix}:owners", token, owner)
    client.hset(f"{prefix}:info", token, '{"host": "h", "pid": 7, "user": "mallory"}')
    client.set(f"{prefix}:n", "1")


def forget(client: redis.Redis, name: str) -> None:
    """Delete every key of *name*."""
    if found := client.keys(f"{key_prefix('default', name)}:*"):
        client.delete(*found)


def test_a_window_until_the_year_3000_is_busy_at_once_and_read_back_capped(
    redis_uri: str, co_tenant: redis.Redis, name: str
) -> None:
    """A forged window ending in 3000: 75 at once with one line; status shows it within a year."""
    forge_holder(co_tenant, name, "ghost", f"0 1 1 {YEAR_3000_MS}", YEAR_3000_MS)
    try:
        # An hour's wait, shorter than the window: one that waited it out would fail `lockrun`'s
        # 60 s (the hang guard), so 75 within it is "at once", however loaded the machine.
        busy = lockrun("--uri", redis_uri, "-n", name, "-w", "3600", "--", "true")
        clean(busy, ExitCode.BUSY)
        assert "--hold-at-least" in busy.stderr
        (holder,) = lock_state(redis_uri, name)["holders"]
        assert holder["until"] <= time.time() + MAX_WAIT + 60
        verbose = lockrun("-v", "--uri", redis_uri, "-n", name, "-w", "1", "--", "true")
        assert verbose.returncode == ExitCode.BUSY  # -v: a progress line, then the busy one
        assert "Traceback" not in verbose.stderr
        statuses_read(redis_uri, name)
        lived = co_tenant.pttl(f"{key_prefix('default', name)}:holders")
        assert lived <= MAX_WAIT * 1000 + 60_000  # the keys do not outlive the longest window
    finally:
        forget(co_tenant, name)


# Each entry is read by the scripts (the acquisition's Lua) and by the status decoder: in this
# process, on the session's Redis, with the busy line's holders and what `lockrun status`
# prints of them. The command line reads the same once, below.
OWNERS_ENTRIES = [
    "0 1 1 zz",
    "0 1 1 y:",
    "0 1 1 y:nobody",
    "0 0 1 99999999999999999999",
    "0 1 1  1",
    "s:",
]


@pytest.mark.parametrize("owner", OWNERS_ENTRIES)
def test_an_owners_entry_with_any_suffix_is_read_not_believed(
    redis_uri: str, co_tenant: redis.Redis, name: str, owner: str
) -> None:
    """A ghost holder whose owners entry has garbage after its three numbers: busy, no crash."""
    forge_holder(co_tenant, name, "ghost", owner, 10**13)  # ms: the year 2286
    backend = open_backend(parse_uri(redis_uri), ttl=5.0)
    try:
        for shared in (False, True):
            holder = Holder.me(["x"])._replace(shared=shared)
            request = Request("default", name, 1, 5.0, holder, shared=shared)
            with pytest.raises(LockBusy, match="busy, held by mallory@h pid 7"):  # 75's line
                acquire(backend, request, 0)
        for states in (backend.status("default", name), backend.status("default", None)):
            for as_json in (False, True):
                status_text(states, as_json=as_json, empty="default")
    finally:
        backend.close()
        forget(co_tenant, name)


def test_a_ghost_with_a_garbage_owners_entry_is_busy_to_the_command_line(
    redis_uri: str, co_tenant: redis.Redis, name: str
) -> None:
    """The same through `lockrun` and `lockrun status`: 75 in one line, statuses read."""
    forge_holder(co_tenant, name, "ghost", "0 1 1 y:nobody", 10**13)
    try:
        clean(lockrun("--uri", redis_uri, "-n", name, "--", "true"), ExitCode.BUSY)
        clean(lockrun("--uri", redis_uri, "-n", name, "--shared", "--", "true"), ExitCode.BUSY)
        statuses_read(redis_uri, name)
    finally:
        forget(co_tenant, name)


def test_a_forged_reader_lets_readers_in_and_keeps_writers_out(
    redis_uri: str, co_tenant: redis.Redis, name: str
) -> None:
    """A token in the reader form is a reader: a --shared run shares with it, a writer waits."""
    forge_holder(co_tenant, name, "s:ghost", "0 0 1", 10**13)
    try:
        clean(lockrun("--uri", redis_uri, "-n", name, "--shared", "--", "true"), 0)
        clean(lockrun("--uri", redis_uri, "-n", name, "--", "true"), ExitCode.BUSY)
        state = lock_state(redis_uri, name)
        assert [holder["shared"] for holder in state["holders"]] == [True]
    finally:
        forget(co_tenant, name)


def test_a_forged_give_way_mark_for_a_live_holder_is_no_take_over(
    redis_uri: str, co_tenant: redis.Redis, name: str
) -> None:
    """Owners rewritten to 'y:TOKEN' under a running lease: the renewal calls it lost, not 79."""
    backend = open_backend(parse_uri(redis_uri), ttl=5)
    try:
        lease = backend.acquire(Request("default", name, 1, 5.0, Holder.me(["x"])), 0)
        assert lease is not None
        owners = f"{key_prefix('default', name)}:owners"
        (token,) = co_tenant.hkeys(owners)
        co_tenant.hset(owners, token, "0 1 1 y:nobody")
        with pytest.raises(Exception, match="gone"):
            lease.refresh()
        lease.release()
    finally:
        backend.close()
        forget(co_tenant, name)


owners_values = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda numbers, tail: " ".join(map(str, numbers)) + tail,
        st.lists(st.integers(min_value=0, max_value=2**70), min_size=3, max_size=4),
        st.sampled_from(["", " y:", " y:t", " y:ghost", "  ", " 1e99", " -1"]),
    ),
)
scores = st.one_of(
    st.floats(allow_nan=False),
    st.integers(min_value=-(2**60), max_value=2**60).map(float),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.lists(st.sampled_from(["t", "s:t", "ghost", "s:ghost", "s:", ""]), max_size=3),
    owner=owners_values,
    score=scores,
    stop=st.one_of(
        st.text(max_size=30), holder_like().map(lambda record: f"t {json.dumps(record)}")
    ),
    shared=st.booleans(),
    take_over=st.booleans(),
)
def test_redis_mode_records_from_anyone_never_break_an_acquisition(
    redis_uri: str,
    co_tenant: redis.Redis,
    tokens: list[str],
    owner: str,
    score: float,
    stop: str,
    shared: bool,
    take_over: bool,
) -> None:
    """Forged holders, waiters, owners suffixes and stop keys: a lease, busy, or 79; no error."""
    name = f"t-mode-prop-{time.monotonic_ns()}"
    prefix = key_prefix("default", name)
    for token in tokens:
        co_tenant.zadd(f"{prefix}:holders", {token: score})
        co_tenant.zadd(f"{prefix}:queue", {token: 1})
        co_tenant.zadd(f"{prefix}:waiters", {token: score})
        co_tenant.hset(f"{prefix}:owners", token, owner)
    co_tenant.set(f"{prefix}:stop", stop)
    backend = open_backend(parse_uri(redis_uri), ttl=5.0)
    holder = Holder.me(["x"])._replace(shared=shared)
    request = Request("default", name, 1, 5.0, holder, shared=shared, take_over=take_over)
    try:
        try:
            lease = backend.acquire(request, now() + 0.3)
        except TakenOver:
            lease = None
        if lease is not None:
            assert (lease.fence is None) == shared
            lease.bells  # noqa: B018 - arms the bell
            with contextlib.suppress(TakenOver, LeaseLost):  # a forged entry may end it
                lease.refresh()
            lease.release(hold=0.1)
        backend.status("default", name)
        backend.status("default", None)
    finally:
        backend.close()
        forget(co_tenant, name)
