"""One lock's queue on etcd: the transaction that looks at it, and what its answer says (A13).

Pure functions over the gateway's JSON, so that a hostile answer is decoded once, here, and
anything that is not etcd's is a `ValueError` the backend reports as one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple

from lockrun.backends import read_identity
from lockrun.backends.etcd.gateway import b64, number, unb64
from lockrun.names import key_part

if TYPE_CHECKING:
    from lockrun.backends import Identity
    from lockrun.backends.etcd.gateway import Watch


PREFIX: Final = "lockrun"


def lock_prefix(namespace: str, name: str | None = None) -> str:
    """Return the prefix of a lock's keys, ``lockrun/NS/NAME/``; without *name*, of NS's."""
    spot = f"{PREFIX}/{key_part(namespace)}/"
    return spot if name is None else f"{spot}{key_part(name)}/"


class Queue(NamedTuple):
    """What one look at a lock's queue says about our key."""

    revision: int  # the store's revision at the look: a watch starts after it
    mine: int  # our key's create revision; 0: it is gone (our lease ended)
    ahead: int  # keys created before ours, of the first N (so we hold a slot when < N)
    before: bytes  # the key just before ours (b"" if none): what a one-slot waiter watches
    owner: Identity | None  # the oldest key's record, where it is one of ours
    oldest: bytes = b""  # the oldest key (the holder of one slot)

    def next_in_line(self) -> bool:
        """Whether only the key we watch is ahead of ours, and it holds the one slot."""
        return self.ahead == 1 and bool(self.before) and self.before == self.oldest

    def head(self) -> Queue:
        """Return this queue once the key ahead of ours went: ours is the oldest."""
        return self._replace(ahead=0, before=b"", owner=None, oldest=b"")


class Turn:
    """A waiter's state between looks: the queue as last seen, its lease, its watch."""

    def __init__(self, queue: Queue, kept: float) -> None:
        """Start from the first look; *kept*: when our lease's grant was sent."""
        self.queue = queue
        self.kept = kept  # when the request that last kept our lease alive was sent
        self.watch: Watch | None = None
        self.stale = False  # a call failed since the last look: look before anything else

    def close(self) -> None:
        """Close the watch, if one is open."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None


def keys_under(prefix: bytes) -> tuple[bytes, bytes]:
    """Return the range of every key starting with *prefix*, which ends in ``/``.

    Its end is the prefix with that last byte raised: ``…/`` → ``…0``.
    """
    return prefix, prefix[:-1] + bytes([prefix[-1] + 1])


def queue_range(prefix: bytes) -> tuple[bytes, bytes]:
    """Return the range of a lock's queue keys, ``PREFIX q/`` up to (not with) ``PREFIX q0``."""
    return keys_under(prefix + b"q/")


def look_body(prefix: bytes, key: bytes, slots: int, put: tuple[str, int] | None) -> dict[str, Any]:
    """Return the transaction that reads the queue around *key*; with *put*, queues it first.

    *put* is our record and lease: the key is put if it was never created (a retried
    transaction finds it there and reads it). Reads: the first *slots* keys (keys only),
    the oldest key's record (its N), and our own key.
    """
    start, end = queue_range(prefix)
    first = {
        "key": b64(start),
        "range_end": b64(end),
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
    }
    reads = [
        {"request_range": {**first, "limit": str(slots), "keys_only": True}},
        {"request_range": {**first, "limit": "1"}},
        {"request_range": {"key": b64(key)}},
    ]
    if put is None:
        return {"compare": [], "success": reads, "failure": []}
    record, lease_id = put
    never = {"target": "CREATE", "key": b64(key), "create_revision": "0", "result": "EQUAL"}
    value = {"key": b64(key), "value": b64(record), "lease": str(lease_id)}
    return {"compare": [never], "success": [{"request_put": value}, *reads], "failure": reads}


def read_look(answer: dict[str, Any]) -> Queue:
    """Decode `look_body`'s answer (no `before` yet: `EtcdBackend.look` asks for it).

    `ValueError` for an answer that is not one etcd gives to that transaction.
    """
    heads, oldest, ours = ranges_of(answer, 3)
    created = number(ours[0], "create_revision") if ours else 0
    ahead = sum(1 for kv in heads if 0 < number(kv, "create_revision") < created)
    value = unb64(oldest[0].get("value")).decode(errors="replace") if oldest else ""
    first = unb64(oldest[0].get("key")) if oldest else b""
    revision = number(answer.get("header"), "revision")
    return Queue(revision, created, ahead, b"", read_identity(value) if value else None, first)


def ranges_of(answer: dict[str, Any], count: int) -> list[list[dict[str, Any]]]:
    """Return the key-values of each of a transaction's *count* range reads; else ValueError."""
    responses = answer.get("responses", [])
    if not isinstance(responses, list):
        raise ValueError(responses)  # noqa: TRY004 - callers catch one kind for any bad answer
    found = []
    for response in responses:
        if isinstance(response, dict) and "response_range" in response:
            kvs = kvs_of(response["response_range"])
            if kvs is None:
                raise ValueError(response)
            found.append(kvs)
    if len(found) != count:
        raise ValueError(found)
    return found


def kvs_of(response: object) -> list[dict[str, Any]] | None:
    """Return the key-values of a range's answer; None if it is no range's answer."""
    if not isinstance(response, dict):
        return None
    kvs = response.get("kvs", [])
    if not isinstance(kvs, list) or not all(isinstance(kv, dict) for kv in kvs):
        return None
    return kvs


def group(kvs: list[dict[str, Any]], prefix: bytes, namespace: str) -> dict[str, list[Identity]]:
    """Sort queue keys read under *prefix* into their locks (``lockrun/NS/NAME/``), in order.

    Keys that are not queue keys, and records that are not ours (or of another namespace),
    are passed over: anyone who may write the prefix may write anything there.
    """
    locks: dict[str, list[Identity]] = {}
    for kv in kvs:
        key = unb64(kv.get("key"))
        if not key.startswith(prefix) or b"/q/" not in key:
            continue
        identity = read_identity(unb64(kv.get("value")).decode(errors="replace"))
        if identity is not None and identity.namespace == namespace:
            lock = key[: key.rindex(b"/q/") + 1].decode(errors="replace")
            locks.setdefault(lock, []).append(identity)
    return locks


def slots_held(kvs: list[dict[str, Any]]) -> dict[int, int]:
    """Return lease → slot from the slot keys ``…/s/I`` among *kvs* (N > 1)."""
    held = {}
    for kv in kvs:
        _, marker, slot = unb64(kv.get("key")).rpartition(b"/s/")
        lease = number(kv, "lease")
        if marker and slot.isdigit() and len(slot) <= 4 and lease:  # noqa: PLR2004 - MAX_SLOTS
            held[lease] = int(slot)
    return held
