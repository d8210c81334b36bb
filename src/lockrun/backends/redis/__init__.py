"""Redis: a first-in first-out lease semaphore in Lua (docs/design.md A4).

Every lock is a handful of keys under one hash tag, ``lockrun:{NS/NAME}:…``, so Redis
Cluster keeps them in one slot. Holders are a sorted set of acquisition tokens scored by
lease expiry on the *server's* clock; waiters queue in a sorted set by ticket and each
blocks in BLPOP on its own wake list, which the scripts push to when a slot is the
waiter's to take. Every script is idempotent per token (redis-py and networks retry), reaps
the leases and waits that ran out, and sets a TTL on every key, so a crashed holder or
waiter blocks nobody beyond its lease and nothing stays behind after the last user.

The package, a module per concern:

- ``lua/*.lua`` and `scripts`: the scripts, the keys they name, and each script's ARGV;
- `replies`: each script's reply, decoded once into a named type;
- `uri`: lock URIs (TLS, Sentinel, Cluster) into redis-py settings;
- `wire`, `resp`: commands packed and run in one round trip; replies read within bounds;
- `topology`, `server`, `cluster`: where each call goes (Sentinel's majority, a cluster's
  node) and when a grant is durable; eviction checks;
- `backend`: queue, wait, leave and report; `leases`: a process's lease, and one held by
  no process (acquire --no-keeper).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockrun.backends.redis.backend import RedisBackend
from lockrun.backends.redis.leases import DetachedLease, RedisLease
from lockrun.backends.redis.replies import DETACHED, SHARED
from lockrun.backends.redis.scripts import Claim, key_prefix
from lockrun.backends.redis.uri import Settings, parse
from lockrun.timing import DEFAULT_TTL

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.uri import LockURI

__all__ = [
    "DETACHED",
    "SHARED",
    "Claim",
    "DetachedLease",
    "RedisBackend",
    "RedisLease",
    "Settings",
    "connect",
    "key_prefix",
    "parse",
]


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> RedisBackend:
    """Check *uri*; the first call connects, with timeouts that fit leases of *ttl*."""
    return RedisBackend(parse(uri), ttl or DEFAULT_TTL, warn or (lambda _line: None), note)
