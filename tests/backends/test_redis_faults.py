"""Redis-only faults: a user without CLIENT, leases of different lengths, and key expiry.

What every server backend shares is in tests/contract; here is what only a lock made of
keys with leases has: a releaser that cannot see dead waiters (no CLIENT in the ACL), a
dead waiter whose own ttl bounds the wait, and keys that all expire, but the fence last.
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.support.cli import (
    Held,
    finish,
    holder_pids,
    lock_state,
    lockrun,
    one_line,
    wait_for,
    waiter_pids,
)
from tests.support.harness import CALM, TTL, RedisHarness, read_run

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.servers import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(40)]

SHORT_TTL: Final = 2.0
HOUR: Final = 3600.0  # a lease no test outlives: what comes sooner is not its end

# Every lockrun key and its PTTL, read in one atomic step (nothing changes in between).
KEYS_WITH_TTL: Final = """
local found = {}
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  found[#found + 1] = key
  found[#found + 1] = redis.call('PTTL', key)
end
return found
"""


def lockrun_keys(server: RedisServer) -> dict[str, int]:
    """Return every ``lockrun:*`` key on *server* with its PTTL (-1: none)."""
    reply = server.command("EVAL", KEYS_WITH_TTL, "0", "lockrun:*").splitlines()
    return {key: int(pttl) for key, pttl in zip(reply[::2], reply[1::2], strict=True)}


def test_sigkilled_head_waiter_lapses_within_its_ttl_without_client_list(
    redis_server: RedisServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A Redis user without the CLIENT commands cannot see a dead head: its slot lapses.

    The release hands the slot to the dead head and cannot tell (no CLIENT LIST): the grant
    lapses between ttl/2 and a ttl after (tests/contract sees it passed over at once where
    CLIENT is allowed). `status` then lists only the second waiter.
    """
    redis_server.command("ACL", "SETUSER", "noclient", "on", ">pw", "~*", "&*", "+@all", "-client")
    uri = f"{redis_server.uri}?username=noclient&password=pw"
    # The holder's lease is an hour: the second getting in at all proves the head's grant
    # lapsed by the head's own ttl (a hang guard of 60 s, not a budget, waits for it).
    holder = held("--uri", uri, "-n", name, "--ttl", f"{HOUR:g}")
    options = ("--uri", uri, "-n", name, "--ttl", f"{TTL:g}")
    head, second, _, log, go = RedisHarness("redis", uri).queue_two(spawn, tmp_path, *options)
    try:
        head.send_signal(signal.SIGKILL)
        head.wait(10)
        killed_at = time.time()
        assert holder.finish() == 0
        wait_for(log.exists, timeout=60, what="the second waiter's command")
        waited = read_run(log).begun - killed_at
        print(f"second waiter got in {waited:.2f}s after the head waiter's SIGKILL")
        assert waited > TTL / 4, "passed over without CLIENT LIST"  # lapses ttl/2–ttl on
        assert holder_pids(uri, name) == [second.pid]
        assert waiter_pids(uri, name) == []
    finally:
        go.touch()
    assert finish(second) == 0


def test_dead_head_waiter_blocks_no_longer_than_its_own_ttl(
    redis_server: RedisServer,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A dead waiter blocks others at most its own ttl after its death (docs/design.md, README).

    Users of a name may choose different leases: the holder here has --ttl 3600, the waiters
    --ttl 2. When the head waiter dies and the holder releases, the slot handed to the dead
    head must lapse within the head's own ttl, not the holder's: the second getting in at
    all (60 s hang guard) proves it.
    """
    uri = redis_server.uri
    holder = held("--uri", uri, "-n", name, "--ttl", f"{HOUR:g}")
    options = ("--uri", uri, "-n", name, "--ttl", f"{SHORT_TTL:g}")
    head, second, _, log, go = RedisHarness("redis", uri).queue_two(spawn, tmp_path, *options)
    try:
        head.send_signal(signal.SIGKILL)
        head.wait(10)
        assert holder.finish() == 0
        released = time.time()  # the release granted the dead head before it returned
        for entry in lock_state(uri, name)["holders"]:
            if entry["pid"] == head.pid:  # granted to the dead head: only for its own lease
                ahead = entry["expires"] - released
                assert ahead <= SHORT_TTL + 0.05, f"dead waiter holds the slot {ahead:.1f}s on"
        wait_for(log.exists, timeout=60, what="the second waiter's command")
    finally:
        go.touch()
    assert finish(second) == 0


def test_every_key_expires_and_only_the_fence_outlives_the_lock(
    redis_server: RedisServer,
    name: str,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """Every lockrun key expires, and after the last user only the fence is left.

    While the lock is held or awaited every key has a TTL; a failed try adds no key; SIGINT
    while waiting exits 130 and leaves no waiter; after release only the fence (with a TTL)
    remains.
    """
    uri = redis_server.uri
    prefix = f"lockrun:{{default/{name}}}"
    holder = held("--uri", uri, *CALM, "-n", name)
    holding = lockrun_keys(redis_server)
    assert f"{prefix}:holders" in holding
    assert all(pttl > 0 for pttl in holding.values()), holding

    busy = lockrun("--uri", uri, *CALM, "-n", name, "--", "true")
    assert busy.returncode == 75, busy.stderr
    assert lockrun_keys(redis_server).keys() == holding.keys()

    waiter = spawn("--uri", uri, *CALM, "-n", name, "-w", "forever", "--", "true")
    wait_for(lambda: waiter_pids(uri, name) == [waiter.pid], what="the waiter")
    waiting = lockrun_keys(redis_server)
    assert {f"{prefix}:queue", f"{prefix}:waiters"} <= waiting.keys()
    assert all(pttl > 0 for pttl in waiting.values()), waiting

    waiter.send_signal(signal.SIGINT)
    _, err = waiter.communicate(timeout=10)
    assert waiter.returncode == 130, err
    assert name in one_line(err)
    assert waiter_pids(uri, name) == []
    assert redis_server.command("ZCARD", f"{prefix}:queue") == "0"
    assert redis_server.command("ZCARD", f"{prefix}:waiters") == "0"
    left = lockrun_keys(redis_server)
    assert not [key for key in left if ":wake:" in key], left
    assert all(pttl > 0 for pttl in left.values()), left

    assert holder.finish() == 0
    after = lockrun_keys(redis_server)
    assert list(after) == [f"{prefix}:fence"]
    assert after[f"{prefix}:fence"] > 0
