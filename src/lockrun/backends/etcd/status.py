"""`lockrun status` on etcd (docs/design.md A13).

One range read of a lock's keys (or a namespace's), and each holder's lease's end.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Final

from lockrun.backends import LockState
from lockrun.backends.etcd.gateway import b64
from lockrun.backends.etcd.queue import (
    group,
    holding,
    keys_under,
    kvs_of,
    lease_named,
    lock_prefix,
    slots_held,
)
from lockrun.errors import BackendUnavailable

if TYPE_CHECKING:
    from lockrun.backends import Holder
    from lockrun.backends.etcd.backend import EtcdBackend
    from lockrun.backends.etcd.queue import Entry

_MAX_LISTED: Final = 10_000  # queue keys a status reads of one lock, or of a namespace
# A lease's time left comes in whole seconds, and etcd ends leases twice a second.
_LEASE_GRAIN: Final = 1.5


def read(backend: EtcdBackend, namespace: str, name: str | None) -> list[LockState]:
    """Report holders and waiters of *name*, or of every lock in *namespace*."""
    prefix = lock_prefix(namespace, name)
    start, end = keys_under(prefix.encode())
    body = {
        "key": b64(start),
        "range_end": b64(end),
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
        "limit": str(_MAX_LISTED),
    }
    kvs = kvs_of(backend.call("/v3/kv/range", body))
    if kvs is None:
        raise backend.malformed(what="a range")
    locks, held = group(kvs, start, namespace), slots_held(kvs)
    if name is not None and not locks:
        return [LockState(namespace, name, prefix)]
    return [
        _state(backend, namespace, where, queue, held) for where, queue in sorted(locks.items())
    ]


def _state(
    backend: EtcdBackend, namespace: str, where: str, queue: list[Entry], held: dict[int, int]
) -> LockState:
    """Describe one lock from its queue, oldest first: who holds (`holding`), in slots *held*."""
    first = queue[0].identity
    count = holding(queue)
    holders = tuple(
        _described(backend, entry)._replace(
            slot=held.get(lease_named_in(entry), 0) if first.slots > 1 else 0
        )
        for entry in queue[:count]
    )
    waiters = tuple(entry.identity.holder for entry in queue[count:])
    return LockState(namespace, first.name, where, first.slots, holders, waiters)


def _described(backend: EtcdBackend, entry: Entry) -> Holder:
    """Add when the holder's lease ends (or its window does), as the server says."""
    holder = entry.identity.holder
    with contextlib.suppress(BackendUnavailable):
        left = backend.time_to_live(entry.lease)
        if left > 0 and entry.window:
            return holder._replace(until=_window_end(time.time() + left, entry.until))
        if left > 0:
            return holder._replace(expires=time.time() + left)
    return holder


def _window_end(lease_end: float, stated: float | None) -> float:
    """Return a window's end: as its record states it, where its lease agrees, else the lease's.

    etcd tells a lease's time left in whole seconds, cut: the lease ends within
    `_LEASE_GRAIN` after *lease_end*. A record stating an end outside that, anyone's, is
    not believed.
    """
    if stated is not None and lease_end - _LEASE_GRAIN <= stated <= lease_end + _LEASE_GRAIN:
        return stated
    return lease_end


def lease_named_in(entry: Entry) -> int:
    """Return the lease ID a record's token names (16 hex digits); 0 if it names none."""
    return lease_named(entry.identity.token.encode())
