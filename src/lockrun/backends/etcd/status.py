"""`lockrun status` on etcd (docs/design.md A13).

One range read of a lock's keys (or a namespace's), and each holder's lease's end.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Final

from lockrun.backends import LockState
from lockrun.backends.etcd.gateway import b64, number
from lockrun.backends.etcd.queue import group, keys_under, kvs_of, lock_prefix, slots_held
from lockrun.errors import BackendUnavailable

if TYPE_CHECKING:
    from lockrun.backends import Holder, Identity
    from lockrun.backends.etcd.backend import EtcdBackend

_MAX_LISTED: Final = 10_000  # queue keys a status reads of one lock, or of a namespace


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
    backend: EtcdBackend,
    namespace: str,
    where: str,
    queue: list[Identity],
    held: dict[int, int],
) -> LockState:
    """Describe one lock from its queue, oldest first: the first N hold, in slots *held*."""
    slots = queue[0].slots
    holders = tuple(
        _described(backend, identity.holder, identity.token)._replace(
            slot=held.get(lease_of(identity.token), 0) if slots > 1 else 0
        )
        for identity in queue[:slots]
    )
    waiters = tuple(identity.holder for identity in queue[slots:])
    return LockState(namespace, queue[0].name, where, slots, holders, waiters)


def _described(backend: EtcdBackend, holder: Holder, token: str) -> Holder:
    """Add when *holder*'s lease ends, as the server says (`timetolive`)."""
    with contextlib.suppress(BackendUnavailable):
        answer = backend.call("/v3/lease/timetolive", {"ID": str(lease_of(token))})
        left = number(answer, "TTL")
        if left > 0:
            return holder._replace(expires=time.time() + left)
    return holder


def lease_of(token: str) -> int:
    """Return the lease ID a record's token names (16 hex digits); 0 if it names none."""
    try:
        return int(token, 16) if len(token) == 16 else 0  # noqa: PLR2004 - our tokens' length
    except ValueError:
        return 0
