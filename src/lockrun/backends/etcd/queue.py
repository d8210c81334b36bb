"""One lock's queue on etcd: the transaction that looks at it, and what its answer says (A13).

Pure functions over the gateway's JSON, so that a hostile answer is decoded once, here, and
anything that is not etcd's is a `ValueError` the backend reports as one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple

from lockrun.backends import identity_of, read_json
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


class Stop(NamedTuple):
    """The newest take-over request of one kind: when it was made, and the taker's record."""

    created: int  # its key's create revision
    record: str  # the taker's holder record, as `taken_over_by` reads it (anyone's)


class Queue(NamedTuple):
    """What one look at a lock's queue says about our key."""

    revision: int  # the store's revision at the look: a watch starts after it
    mine: int  # our key's create revision; 0: it is gone (our lease ended)
    ahead: int  # keys created before ours, of the first N (so we hold a slot when < N)
    before: bytes  # the key a waiter watches (b"" if none): just before ours, or a writer's
    owner: Identity | None  # the oldest key's record, where it is one of ours
    oldest: bytes = b""  # the oldest key (the holder of one slot)
    # The oldest key's lease, where it is not the one the key is named after: a window
    # (--hold-at-least), whose end that lease's TTL tells. 0: a holder's own lease.
    window: int = 0
    plain: bool = True  # the oldest key is a run's: neither a window nor a detached lease
    writer: bytes = b""  # the oldest writer's marker key (`w/LEASE`), b"" if none
    writer_created: int = 0  # its create revision
    stops: tuple[Stop | None, Stop | None] = (None, None)  # the newest `t/` and `tr/` keys

    def held(self, slots: int, *, shared: bool) -> bool:
        """Whether our key holds a slot: among the first N, or a reader with no writer before it."""
        if shared:
            return not self.writer_created or self.writer_created > self.mine
        return self.ahead < slots

    def next_in_line(self, *, shared: bool) -> bool:
        """Whether the key we watch is the oldest, a run's, and the last thing before our turn.

        A writer watches the key just before its own, a reader the newest writer's marker
        before its own: either is next in line when that is the oldest key and nothing else
        is ahead. Behind a window or a lease with no process, or another waiter, it looks
        again instead: only a run that leaves for a taker says so first (A13).
        """
        if not (self.before and self.plain and self.oldest):
            return False
        if shared:
            return self.before == self.writer and _lease_part(self.writer) == _lease_part(
                self.oldest
            )
        return self.ahead == 1 and self.before == self.oldest

    def stopped_by(self, *, shared: bool) -> Stop | None:
        """Return the take-over request made after our key that stops us, if any.

        A writer's request stops anyone; a reader's stops writers only (it joins readers).
        """
        return stopping(self.stops, self.mine, shared=shared)

    def head(self) -> Queue:
        """Return this queue once the key we watched went: nothing is ahead of ours."""
        return self._replace(
            ahead=0, before=b"", owner=None, oldest=b"", writer=b"", writer_created=0
        )


def stopping(stops: tuple[Stop | None, Stop | None], mine: int, *, shared: bool) -> Stop | None:
    """Return the request of *stops* (the newest ``t/`` and ``tr/``) that stops key *mine*.

    A request made after our key stops us: a writer's anyone, a reader's writers only.
    """
    writer_stop, reader_stop = stops
    for stop in (writer_stop,) if shared else (writer_stop, reader_stop):
        if stop is not None and stop.created > mine > 0:
            return stop
    return None


def _lease_part(key: bytes) -> bytes:
    """Return the LEASE of a key ``…/q/LEASE`` or ``…/w/LEASE``."""
    return key.rpartition(b"/")[2]


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


def queue_key(prefix: bytes, lease_id: int) -> bytes:
    """Return the queue key of lease *lease_id* under lock *prefix*: ``PREFIX q/LEASE``."""
    return prefix + b"q/" + f"{lease_id:016x}".encode()


def marker_of(key: bytes, kind: bytes) -> bytes:
    """Return the key of kind *kind* (``w/``, ``t/``, ``tr/``) beside queue key *key*."""
    lock, _, lease = key.rpartition(b"q/")
    return lock + kind + lease


def look_body(prefix: bytes, key: bytes, slots: int, put: Put | None = None) -> dict[str, Any]:
    """Return the transaction that reads the queue around *key*; with *put*, queues it first.

    *put* says what to write: the key is put if it was never created (a retried
    transaction finds it there and reads it), with a writer's marker ``w/`` and a taker's
    request ``t/`` or ``tr/`` beside it, on the same lease (A13). Reads: the first *slots*
    keys (keys only), the oldest key with its record, our own key, the oldest writer's
    marker, and the newest request of each kind.
    """
    start, end = queue_range(prefix)
    first = {
        "key": b64(start),
        "range_end": b64(end),
        "sort_order": "ASCEND",
        "sort_target": "CREATE",
    }
    writers, writers_end = keys_under(prefix + b"w/")
    reads = [
        {"request_range": {**first, "limit": str(slots), "keys_only": True}},
        {"request_range": {**first, "limit": "1"}},
        {"request_range": {"key": b64(key)}},
        {"request_range": _oldest(writers, writers_end, keys_only=True)},
        *_stop_reads(prefix),
    ]
    if put is None:
        return {"compare": [], "success": reads, "failure": []}
    lease = str(put.lease)
    puts = [{"request_put": {"key": b64(key), "value": b64(put.record), "lease": lease}}]
    if not put.shared:
        puts.append({"request_put": {"key": b64(marker_of(key, b"w/")), "lease": lease}})
    if put.taker:
        stop = marker_of(key, b"tr/" if put.shared else b"t/")
        puts.append({"request_put": {"key": b64(stop), "value": b64(put.taker), "lease": lease}})
    never = {"target": "CREATE", "key": b64(key), "create_revision": "0", "result": "EQUAL"}
    return {"compare": [never], "success": [*puts, *reads], "failure": reads}


class Put(NamedTuple):
    """What an acquirer's first look writes: its record on its lease, in its mode."""

    record: str
    lease: int
    shared: bool = False
    taker: str = ""  # a taker's holder record, for its request's key; "": no take-over


def _oldest(key: bytes, end: bytes, *, keys_only: bool = False) -> dict[str, Any]:
    body = {"key": b64(key), "range_end": b64(end), "sort_order": "ASCEND", "limit": "1"}
    return {**body, "sort_target": "CREATE", "keys_only": keys_only}


def _newest(key: bytes, end: bytes) -> dict[str, Any]:
    body = {"key": b64(key), "range_end": b64(end), "sort_order": "DESCEND", "limit": "1"}
    return {**body, "sort_target": "CREATE"}


def _stop_reads(prefix: bytes) -> list[dict[str, Any]]:
    """Return the reads of the newest take-over request of each kind, ``t/`` then ``tr/``."""
    return [{"request_range": _newest(*keys_under(prefix + kind))} for kind in (b"t/", b"tr/")]


def stops_body(prefix: bytes) -> dict[str, Any]:
    """Return the transaction that reads the newest take-over request of each kind."""
    return {"compare": [], "success": _stop_reads(prefix), "failure": []}


def read_stops(ranges: list[list[dict[str, Any]]]) -> tuple[Stop | None, Stop | None]:
    """Decode the newest request of each kind from their two ranges' key-values."""
    found = []
    for kvs in ranges:
        created = _created(kvs)
        record = unb64(kvs[0].get("value")).decode(errors="replace") if kvs else ""
        found.append(Stop(created, record) if created else None)
    return found[0], found[1]


def read_look(answer: dict[str, Any]) -> Queue:
    """Decode `look_body`'s answer (no `before` yet: `EtcdBackend.look` asks for it).

    `ValueError` for an answer that is not one etcd gives to that transaction.
    """
    heads, oldest, ours, writers, *stops = ranges_of(answer, 6)
    created = _created(ours)
    ahead = sum(1 for kv in heads if 0 < number(kv, "create_revision") < created)
    value = unb64(oldest[0].get("value")).decode(errors="replace") if oldest else ""
    record = read_json(value) if value else None
    first = unb64(oldest[0].get("key")) if oldest else b""
    window = _window(oldest[0], first) if oldest else 0
    return Queue(
        number(answer.get("header"), "revision"),
        created,
        ahead,
        b"",
        identity_of(record),
        first,
        window=window,
        plain=not window and not is_detached(record),
        writer=unb64(writers[0].get("key")) if writers else b"",
        writer_created=_created(writers),
        stops=read_stops(stops),
    )


def _created(kvs: list[dict[str, Any]]) -> int:
    """Return the create revision of the first of *kvs*; 0 if there is none."""
    return number(kvs[0], "create_revision") if kvs else 0


def _window(kv: dict[str, Any], key: bytes) -> int:
    """Return the lease *kv* (of queue key *key*) is on if it is not the one its name says."""
    lease = number(kv, "lease")
    return lease if lease and lease != lease_named(key) else 0


def lease_named(key: bytes) -> int:
    """Return the lease ID a key ``…/LEASE`` is named after (16 hex digits); 0 if none."""
    name = _lease_part(key)
    try:
        return int(name, 16) if len(name) == 16 else 0  # noqa: PLR2004 - our names' length
    except ValueError:
        return 0


def is_detached(record: object) -> bool:
    """Whether a queue key's *record* (its JSON, decoded) says no process keeps its lease."""
    return isinstance(record, dict) and record.get("detached") is True


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


class Entry(NamedTuple):
    """One queue key as `status` reads it: its record, and what the keys say about it."""

    identity: Identity
    lease: int  # the lease the key is on: its own, or a window's
    window: bool  # on a lease not named in the key: a --hold-at-least window
    until: float | None = None  # the window's end its record states, to the ms (`status`)


def group(kvs: list[dict[str, Any]], prefix: bytes, namespace: str) -> dict[str, list[Entry]]:
    """Sort queue keys read under *prefix* into their locks (``lockrun/NS/NAME/``), in order.

    What the keys say wins over what a record says (anyone may write one): a key without
    its writer's marker is a reader's, one on another lease than its name's a window.
    Keys that are not queue keys, and records that are not ours (or of another
    namespace), are passed over: anyone who may write the prefix may write anything there.
    """
    keys = [unb64(kv.get("key")) for kv in kvs]
    present = set(keys)
    locks: dict[str, list[Entry]] = {}
    for key, kv in zip(keys, kvs, strict=True):
        if not key.startswith(prefix) or b"/q/" not in key:
            continue
        record = read_json(unb64(kv.get("value")).decode(errors="replace"))
        identity = identity_of(record)
        if identity is None or identity.namespace != namespace:
            continue
        window = _window(kv, key)
        holder = identity.holder._replace(
            shared=marker_of(key, b"w/") not in present,
            until=None,
            detached=not window and is_detached(record),
        )
        lock = key[: key.rindex(b"/q/") + 1].decode(errors="replace")
        lease = window or number(kv, "lease")
        until = identity.holder.until
        entry = Entry(identity._replace(holder=holder), lease, bool(window), until)
        locks.setdefault(lock, []).append(entry)
    return locks


def holding(queue: list[Entry]) -> int:
    """Return how many of a lock's *queue* (oldest first) hold: N, a writer, or the readers."""
    slots = queue[0].identity.slots
    if slots > 1 or not queue[0].identity.holder.shared:
        return slots
    return next(
        (i for i, entry in enumerate(queue) if not entry.identity.holder.shared), len(queue)
    )


def slots_held(kvs: list[dict[str, Any]]) -> dict[int, int]:
    """Return lease → slot from the slot keys ``…/s/I`` among *kvs* (N > 1)."""
    held = {}
    for kv in kvs:
        _, marker, slot = unb64(kv.get("key")).rpartition(b"/s/")
        lease = number(kv, "lease")
        if marker and slot.isdigit() and len(slot) <= 4 and lease:  # noqa: PLR2004 - MAX_SLOTS
            held[lease] = int(slot)
    return held
