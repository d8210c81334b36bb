"""The etcd backend: a lease per acquirer, its queue key ordered by create revision (A13).

docs/design.md A13 gives the algorithm; docs/backends.md "etcd" what is stored.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Final, Literal

from lockrun.backends import LockState, Request, slots_mismatch, taken_over_by, write_json
from lockrun.backends.etcd import status
from lockrun.backends.etcd.gateway import (
    Gateway,
    Outage,
    Refused,
    Unreachable,
    b64,
    number,
    unb64,
)
from lockrun.backends.etcd.lease import (
    DetachedLease,
    EtcdLease,
    lease_for,
    record_of,
    window_for,
)
from lockrun.backends.etcd.queue import (
    Put,
    Queue,
    Stop,
    Turn,
    keys_under,
    kvs_of,
    lock_prefix,
    look_body,
    marker_of,
    queue_range,
    ranges_of,
    read_look,
    read_stops,
    stopping,
    stops_body,
)
from lockrun.errors import BackendUnavailable, Interrupted, TakenOver
from lockrun.lease_clock import MARGIN
from lockrun.timing import RECONNECT_INTERVAL, now

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from lockrun.backends.etcd.gateway import Watch
    from lockrun.backends.etcd.uri import Settings

# Of a lease's ttl since its last keep-alive was sent, how much it surely still runs on the
# server (A10's deadline: the rest is the reserve against drift and scheduling).
_SURE: Final = 1 - MARGIN


class EtcdBackend:
    """The members of one etcd cluster, and this process's leases on it."""

    def __init__(
        self, settings: Settings, ttl: float, timeout: float, note: Callable[[str], None]
    ) -> None:
        """Remember *settings*; nothing is asked until the first call."""
        self.settings = settings
        self.ttl = ttl
        self.note = note
        self.gateway = Gateway(settings, timeout)
        self.heard: float | None = None  # when (`timing.now`) a member last answered
        self.interrupted = threading.Event()  # set by `interrupt`: every wait ends
        self._watching: Watch | None = None  # the watch a wait sleeps on, for `interrupt`
        self._busy = threading.Lock()  # one call at a time on the kept connection

    @property
    def timeout(self) -> float:
        """How long a connect, or any one answer, may take."""
        return self.gateway.timeout

    def call(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """One request to the cluster (`Gateway.call`); a refusal is one line, 69."""
        with self._busy:
            try:
                answer = self.gateway.call(path, body)
            except Refused as refused:
                raise BackendUnavailable(f"{self.settings.where}: {refused.message}") from None
            self.heard = now()
            return answer

    # -- acquire ---------------------------------------------------------------------------

    def acquire(self, request: Request, deadline: float | None) -> EtcdLease | None:
        """Queue a key on a lease of ours and watch the queue until a slot is ours (A13)."""
        prefix = lock_prefix(request.namespace, request.name).encode()
        while True:
            lease_id = lease_for(request.lease_id)
            sent = now()
            ttl = self.grant(lease_id, request.ttl)
            key = prefix + b"q/" + f"{lease_id:016x}".encode()
            try:
                lease = self._queue(request, prefix, key, lease_id, sent, ttl, deadline)
            except BaseException:
                self.revoke(lease_id)
                raise
            if lease is None:
                self.revoke(lease_id)  # the deadline passed: our key goes with the lease
            if lease is not False:
                return lease
            # our lease ran out while we waited (a stall, an outage): queue again, at the back

    def grant(self, lease_id: int, ttl: float) -> int:
        """Make lease *lease_id* of about *ttl* seconds; return the TTL the server gave it.

        The ID is ours, so that a grant retried on another member makes no second lease.
        """
        body = {"ID": str(lease_id), "TTL": str(max(1, math.ceil(ttl)))}
        try:
            answer = self.call("/v3/lease/grant", body)
        except BackendUnavailable as err:
            if "lease already exists" not in str(err):
                raise
            return max(1, math.ceil(ttl))  # our first try's answer was lost: it is ours
        return number(answer, "TTL") or max(1, math.ceil(ttl))

    def _queue(
        self,
        request: Request,
        prefix: bytes,
        key: bytes,
        lease_id: int,
        sent: float,
        ttl: int,
        deadline: float | None,
    ) -> EtcdLease | Literal[False] | None:
        """Put our key and wait our turn; False when our lease ended first (queue again).

        `TakenOver` when a take-over was asked after our key: we give way, nothing held.
        """
        record = record_of(request, lease_id, request.holder)
        taker = write_json(request.holder.to_dict()) if request.take_over else ""
        put = Put(record, lease_id, shared=request.shared, taker=taker)
        turn = Turn(self.look(prefix, key, request, put), sent)
        waited = False
        try:
            while turn.queue.mine:  # 0: our key went with our lease
                self._check_turn(request, turn.queue, key, record, lease_id)
                if turn.queue.held(request.slots, shared=request.shared):
                    lease = self._granted(request, turn, key, lease_id, ttl)
                    if waited or request.hold > 0:  # dated from the grant, not from the wait
                        lease.redate(time.time(), now=bool(request.lease_id))
                    return lease
                waited = True
                pause = _pause(deadline, turn.kept + request.ttl / 3)
                if pause is None or self._window_outlasts(turn.queue, deadline):
                    return None
                try:
                    if not self._wait(turn, prefix, key, lease_id, request, pause):
                        return False
                except Outage as err:
                    self.ride_out(err, request.ttl, deadline)
                    turn.close()
                    turn.stale = True
                self._check_interrupted(request)
            return False
        finally:
            turn.close()

    def _check_turn(
        self, request: Request, queue: Queue, key: bytes, record: str, lease_id: int
    ) -> None:
        """Refuse another N (78); give way to a take-over asked after our key (79).

        Giving way, our key is put again before our lease goes, so that the waiter behind
        us looks rather than takes the hand-over's short cut (A13).
        """
        owner = queue.owner
        if owner is not None and owner.slots != request.slots:
            raise slots_mismatch(request, owner.slots, owner.holder, self.settings.where)
        stop = queue.stopped_by(shared=request.shared)
        if stop is not None:
            self.touch(key, record, lease_id, writer=not request.shared)
            raise TakenOver(taken_over_by(stop.record))

    def _granted(
        self, request: Request, turn: Turn, key: bytes, lease_id: int, ttl: int
    ) -> EtcdLease:
        """Return the lease of a slot just found ours (a slot key claimed for N > 1)."""
        prefix = key[: key.rindex(b"q/")]
        slot = self.claim_slot(prefix, lease_id, request.slots)
        lease = EtcdLease(self, request, key, turn.queue, slot, turn.kept, ttl)
        if request.lease_id and request.hold > 0:  # --no-keeper's window runs from the grant
            self.grant(window_for(lease_id), request.hold)
        return lease

    def _window_outlasts(self, queue: Queue, deadline: float | None) -> bool:
        """Whether the window that holds the lock ends after *deadline* (busy at once).

        The window's end is its lease's TTL, asked of the server: never the hosts' clocks.
        """
        if not queue.window or deadline is None:
            return False
        left = self.time_to_live(queue.window)
        return left > 0 and now() + left > deadline

    def _wait(
        self,
        turn: Turn,
        prefix: bytes,
        key: bytes,
        lease_id: int,
        request: Request,
        pause: float,
    ) -> bool:
        """Keep our lease alive if it is due, else watch for up to *pause* s and look again.

        False: our lease is gone. A one-slot waiter next in line whose watched key (the
        holder's) went is the head without a look: no key can be created before ours, and
        ours is there while our lease surely is (A10's deadline; A13, the hand-over).
        """
        if turn.stale:
            turn.queue, turn.stale = self.look(prefix, key, request), False
            return True
        if pause <= 0:
            sent = now()
            alive = self.keep_alive(lease_id)
            turn.kept = sent
            return alive
        watch = self._watch_for(turn, prefix, request)
        moved = "changed" if watch is None else watch.moved(pause)
        if moved == "deleted" and self._surely_head(turn, request):
            turn.queue = turn.queue.head()
        elif moved:
            turn.queue = self.look(prefix, key, request)
        if moved and request.slots == 1:
            turn.close()  # another key may be just before ours now
        return True

    def _watch_for(self, turn: Turn, prefix: bytes, request: Request) -> Watch | None:
        """Return the waiter's watch, made anew if it has none open (None: nothing to watch).

        After `_watching` was set (in `watch`), the interrupt flag is looked at: an
        `interrupt` that came before could cut nothing, so it is seen before the read.
        """
        if turn.watch is None or not turn.watch.open:
            turn.watch = self.watch(prefix, turn.queue, request.slots)
        self._check_interrupted(request)
        return turn.watch

    @staticmethod
    def _surely_head(turn: Turn, request: Request) -> bool:
        """Whether the deletion just seen makes us the head, without a look.

        We were next in line behind the holder, and our own key is surely there (our lease
        within A10's deadline).
        """
        sure = now() < turn.kept + _SURE * request.ttl
        return turn.queue.next_in_line(shared=request.shared) and sure

    def ride_out(self, err: Outage, ttl: float, deadline: float | None) -> None:
        """Pause before asking again after no member answered a queued waiter; else raise *err*.

        A waiter rides out a restart or a leader election for up to a ttl since a member
        last answered (its lease, and so its place, may lapse meanwhile: it then queues
        again), within its --wait. As on Redis (`RedisBackend.ride_out`).
        """
        current = now()
        if self.heard is None or current - self.heard > ttl:
            raise err
        if deadline is not None and current >= deadline:
            raise err
        self.interrupted.wait(min(RECONNECT_INTERVAL, ttl / 10))

    def interrupt(self) -> None:
        """From another thread: end a waiting `acquire` at once; it raises `Interrupted`.

        The watch it sleeps on is cut (shutdown), so its read returns now (`AsyncLock`'s
        cancel, aio.py).
        """
        self.interrupted.set()
        watching = self._watching
        if watching is not None:
            watching.cut()

    def _check_interrupted(self, request: Request) -> None:
        if self.interrupted.is_set():
            msg = f"the wait for {request.name} was interrupted; nothing is held"
            raise Interrupted(msg, signo=signal.SIGINT)

    def watch(self, prefix: bytes, queue: Queue, slots: int) -> Watch | None:
        """Watch what must go for our turn: the key before ours, or any key of N's queue.

        One slot: the key a writer has just before its own (or the writer a reader waits
        for), its puts too (A13). From the look's revision on, so nothing that happened
        since is missed. None where there is nothing to watch (it went meanwhile): look again.
        """
        if slots == 1 and not queue.before:
            return None
        key, end = (queue.before, b"") if slots == 1 else queue_range(prefix)
        watch = self.gateway.watch()
        self._watching = watch
        try:
            watch.start(key, end, queue.revision + 1, puts=slots == 1)
        except Unreachable as err:
            raise self.gateway.unavailable(err) from err
        except Refused as refused:
            raise BackendUnavailable(f"{self.settings.where}: {refused.message}") from None
        return watch

    def look(self, prefix: bytes, key: bytes, request: Request, put: Put | None = None) -> Queue:
        """Read the queue around our *key* in one transaction (`look_body`); with *put*, queue it.

        A one-slot waiter asks once more for the key it watches: a writer the key just
        before its own, a reader the newest writer's marker before its own.
        """
        answer = self.call("/v3/kv/txn", look_body(prefix, key, request.slots, put))
        try:
            queue = read_look(answer)
        except ValueError:
            raise self.malformed(what="a transaction") from None
        if not queue.mine or request.slots > 1 or queue.held(1, shared=request.shared):
            return queue
        kind = b"w/" if request.shared else b"q/"
        return queue._replace(before=self.just_before(prefix + kind, queue.mine))

    def just_before(self, under: bytes, created: int) -> bytes:
        """Return the key under *under* created last before revision *created* (b"" if none)."""
        start, end = keys_under(under)
        body = {
            "key": b64(start),
            "range_end": b64(end),
            "sort_order": "DESCEND",
            "sort_target": "CREATE",
            "max_create_revision": str(created - 1),
            "limit": "1",
            "keys_only": True,
        }
        kvs = kvs_of(self.call("/v3/kv/range", body)) or []
        return unb64(kvs[0].get("key")) if kvs else b""

    def claim_slot(self, prefix: bytes, lease_id: int, slots: int) -> int:
        """Take the lowest free slot key ``s/I`` on our lease (N > 1); 0 for one slot."""
        if slots == 1:
            return 0
        start, end = keys_under(prefix + b"s/")
        while True:
            body = {
                "key": b64(start),
                "range_end": b64(end),
                "keys_only": True,
                "limit": str(slots + 1),
            }
            taken = {unb64(kv.get("key")) for kv in kvs_of(self.call("/v3/kv/range", body)) or []}
            free = next((i for i in range(slots) if start + str(i).encode() not in taken), None)
            if free is None:
                raise self.malformed(what="the slot keys")  # N holders have N keys: someone else's
            slot_key = b64(start + str(free).encode())
            unclaimed = {
                "target": "CREATE",
                "key": slot_key,
                "create_revision": "0",
                "result": "EQUAL",
            }
            put = {"request_put": {"key": slot_key, "value": b64(b""), "lease": str(lease_id)}}
            answer = self.call("/v3/kv/txn", {"compare": [unclaimed], "success": [put]})
            if answer.get("succeeded") is True:
                return free

    # -- the lease ---------------------------------------------------------------------------

    def keep_alive(self, lease_id: int) -> bool:
        """Extend lease *lease_id* by its TTL; False if the server no longer has it."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease_id)})
        result = answer.get("result")
        return number(result, "TTL") > 0

    def time_to_live(self, lease_id: int) -> float:
        """Return the seconds lease *lease_id* has left on the server's clock; 0 if none."""
        answer = self.call("/v3/lease/timetolive", {"ID": str(lease_id)})
        return float(max(0, number(answer, "TTL")))

    def touch(self, key: bytes, record: str, lease_id: int, *, writer: bool = False) -> None:
        """Put our queue key *key* again with *record*, if it is still ours (best effort).

        A put event for whoever watches it: the next waiter looks (A13). *writer*: our
        writer's marker too, which readers watch.
        """
        lease = str(lease_id)
        puts = [{"request_put": {"key": b64(key), "value": b64(record), "lease": lease}}]
        if writer:
            puts.append({"request_put": {"key": b64(marker_of(key, b"w/")), "lease": lease}})
        with contextlib.suppress(BackendUnavailable):
            self.call("/v3/kv/txn", {"compare": [_on(key, lease_id)], "success": puts})

    def stops(self, key: bytes) -> tuple[Stop | None, Stop | None]:
        """Read the newest take-over request of each kind of the lock of queue key *key*."""
        _, stops = self.created_and_stops(key)
        return stops

    def created_and_stops(self, key: bytes) -> tuple[int, tuple[Stop | None, Stop | None]]:
        """Read queue key *key*'s create revision (0: gone) and the lock's newest requests."""
        prefix = key[: key.rindex(b"q/")]
        body = stops_body(prefix)
        body["success"].append({"request_range": {"key": b64(key), "keys_only": True}})
        try:
            *stops, ours = ranges_of(self.call("/v3/kv/txn", body), 3)
        except ValueError:
            raise self.malformed(what="a transaction") from None
        return (number(ours[0], "create_revision") if ours else 0), read_stops(stops)

    def move_onto(
        self, key: bytes, lease_id: int, window: int, *, writer: bool, record: str = ""
    ) -> bool:
        """Move queue key *key* (and a writer's marker) from lease *lease_id* onto *window*.

        A put of an existing key keeps its create revision: the place, and the fence, stay
        (A13). *record*: the key's new value (the window's end), else it keeps its own.
        Whether it was still ours to move.
        """
        lease = str(window)
        value = {"value": b64(record)} if record else {"ignore_value": True}
        puts = [{"request_put": {"key": b64(key), "lease": lease, **value}}]
        if writer:
            marker: dict[str, object] = {"key": b64(marker_of(key, b"w/")), "lease": lease}
            puts.append({"request_put": marker})
        answer = self.call("/v3/kv/txn", {"compare": [_on(key, lease_id)], "success": puts})
        return answer.get("succeeded") is True

    def leave_window(self, key: bytes, lease_id: int, mine: int, hold: float, record: str) -> None:
        """Keep the slot of queue key *key* taken *hold* more seconds with no process of ours.

        The window is a lease of its own, which a take-over waiting now takes back at once
        (a taker asked for the lock now: docs/semantics.md). Best effort: a window the
        server did not hear of is no window, as a killed run leaves none.
        """
        window = lease_for("")
        try:
            self.grant(window, hold)
            moved = self.move_onto(key, lease_id, window, writer=True, record=record)
            stopped = stopping(self.stops(key), mine, shared=False) is not None
        except BackendUnavailable:
            moved, stopped = False, False
        if not moved or stopped:
            self.revoke(window)

    def revoke(self, lease_id: int) -> bool:
        """Revoke lease *lease_id*, deleting its keys; whether the server heard it (best effort)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease_id)})
        except BackendUnavailable:
            return False
        return True

    def abandon(self, orphan: bytes) -> None:
        """Free the lease of a lockrun that died (`EtcdLease.orphan`), in its guardian."""
        self.revoke(int(orphan))

    # -- status ---------------------------------------------------------------------------

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace* (`status`)."""
        return status.read(self, namespace, name)

    @property
    def where(self) -> str:
        """The URI, with no password: for messages."""
        return self.settings.where

    def place(self) -> str:
        """Name the cluster we reach, alike for every spelling of its URI, with no credentials.

        Its members, hosts in lower case, in any order (`lockrun.detached`'s tokens).
        """
        members = sorted(f"{host.lower()}:{port}" for host, port in self.settings.endpoints)
        return "etcd " + ",".join(members)

    def detached(self, request: Request, hold: float) -> DetachedLease:
        """Return the lease that *request*'s ``lease_id`` names, held by no process."""
        return DetachedLease(self, request, hold)

    def malformed(self, what: str) -> BackendUnavailable:
        """Return the one line for an answer that is not what etcd sends."""
        return BackendUnavailable(f"{self.settings.where}: {what} came back malformed")

    def close(self) -> None:
        """Close the connections; leases are revoked by their own `release`."""
        self.gateway.close()


def _pause(deadline: float | None, renewal: float) -> float | None:
    """Return how long a waiter may watch before it must act; None once *deadline* passed.

    0 or less: our lease is due for its keep-alive (at *renewal*) first.
    """
    current = now()
    if deadline is not None and deadline <= current:
        return None
    due = renewal - current
    return due if deadline is None else min(due, deadline - current)


def _on(key: bytes, lease_id: int) -> dict[str, str]:
    """Return the compare that key *key* is on lease *lease_id* (still ours)."""
    return {"target": "LEASE", "key": b64(key), "lease": str(lease_id), "result": "EQUAL"}
