"""The Python API on Redis: leases renewed in the background, and a lost lease reported."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import Lock, LockBusy
from lockrun.errors import LeaseLost

if TYPE_CHECKING:
    from tests.support.servers import RedisServer


def test_api_lease_outlives_its_ttl_while_the_block_runs(redis_uri: str, name: str) -> None:
    """A block that runs for several ttls keeps the lock: a background thread renews it."""
    with Lock(name, uri=redis_uri, ttl=1):
        time.sleep(2.5)
        with pytest.raises(LockBusy), Lock(name, uri=redis_uri, ttl=1):
            pass
    with Lock(name, uri=redis_uri, ttl=1) as lease:
        assert lease.slot == 0


def test_api_reports_a_lease_lost_while_the_block_ran(redis_server: RedisServer, name: str) -> None:
    """FLUSHALL during the block: leaving it raises LeaseLost, and the name is free again."""
    lock = Lock(name, uri=redis_server.uri, ttl=1.5)
    lock.acquire()
    redis_server.command("FLUSHALL")
    time.sleep(1.5)  # more than ttl/3: a renewal has found the lease gone
    with pytest.raises(LeaseLost, match="lease is gone"):
        lock.release()
    with Lock(name, uri=redis_server.uri) as lease:
        assert lease.slot == 0


def test_api_reports_a_lease_it_could_not_confirm(redis_server: RedisServer, name: str) -> None:
    """The server gone for longer than the ttl: leaving the block raises LeaseLost."""
    lock = Lock(name, uri=redis_server.uri, ttl=1)
    lock.acquire()
    redis_server.stop()
    time.sleep(2.5)  # renewals fail for more than a ttl
    with pytest.raises(LeaseLost, match="could not be confirmed"):
        lock.release()


def test_api_release_stops_renewing(redis_uri: str, name: str) -> None:
    """Leaving the block stops and joins the renewal thread; nothing runs on afterwards."""
    with Lock(name, uri=redis_uri, ttl=1):
        assert "lockrun-renewer" in {thread.name for thread in threading.enumerate()}
    assert "lockrun-renewer" not in {thread.name for thread in threading.enumerate()}
