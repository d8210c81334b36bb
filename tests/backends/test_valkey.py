"""Valkey, the fork of Redis, under the Redis backend: the servers, and the take-over bell.

The contract suite runs its @on_valkey_too scenarios on the session's Valkey and Valkey
cluster (tests/support/harness.py): a lock and its busy status, slots, fences, the queue's
order, `status --check`, a keeper, a killed keeper's lease, a take-over. Here: that those
servers are Valkey indeed, and that its RESP3 tracking push tells a holder of a take-over
at once, as Redis's does (docs/backends.md "Redis").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis

from tests.support.cli import RING_TTL, take_over_ring

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.clusters import Cluster
    from tests.support.servers import RedisServer


def test_the_servers_are_valkey(
    valkey: RedisServer, valkey_cluster: Cluster, record: Callable[..., None]
) -> None:
    """The session's Valkey and every node of its cluster say they are Valkey 9."""
    versions = set()
    for server in [valkey, *valkey_cluster.servers.values()]:
        with redis.Redis(unix_socket_path=server.socket, decode_responses=True) as client:
            info = client.info("server")
        assert info["server_name"] == "valkey", info
        versions.add(info["valkey_version"])
    (version,) = versions
    assert version.startswith("9."), version
    record("Valkey under test", version=version)


def test_a_take_over_rings_the_holders_bell(
    valkey: RedisServer, name: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    """With an hour's lease, the holder's command gets TERM within the taker's wait.

    Its renewals come every 20 minutes: only the tracking push (the bell) is that fast.
    """
    rang = take_over_ring(valkey.uri, tmp_path, name)
    record("Valkey take-over: the taker's start to the holder's TERM", seconds=rang)
    assert rang < RING_TTL / 3
