"""The etcd backend: a lease per acquirer, its queue key ordered by create revision (A13).

docs/design.md A13 gives the algorithm; docs/backends.md "etcd" what is stored.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Final, Literal

from lockrun.backends import LockState, Request, slots_mismatch, write_json
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
from lockrun.backends.etcd.queue import (
    Queue,
    Turn,
    keys_under,
    kvs_of,
    lock_prefix,
    look_body,
    queue_range,
    read_look,
)
from lockrun.errors import BackendUnavailable, Interrupted, LeaseLost
from lockrun.lease_clock import MARGIN
from lockrun.timing import RECONNECT_INTERVAL, now

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from lockrun.backends import Holder
    from lockrun.backends.etcd.gateway import Watch
    from lockrun.backends.etcd.uri import Settings

_NOT_FOUND: Final = 5  # gRPC's NotFound: "requested lease not found"
# Of a lease's ttl since its last keep-alive was sent, how much it surely still runs on the
# server (A10's deadline: the rest is the reserve against drift and scheduling).
_SURE: Final = 1 - MARGIN
_GONE: Final = (
    "its etcd lease is gone: it expired (nobody kept it alive within its --ttl), was "
    "revoked, or etcd lost it"
)


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
            # 63 random bits (etcd's IDs are positive int64s); os.urandom, since secrets
            # loads hashlib and with it OpenSSL, a few ms of every run's start-up (#32)
            lease_id = int.from_bytes(os.urandom(8), "big") >> 1 or 1
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
        """Put our key and wait our turn; False when our lease ended first (queue again)."""
        record = _record(request, lease_id, request.holder)
        turn = Turn(self.look(prefix, key, request.slots, put=(record, lease_id)), sent)
        waited = False
        try:
            while turn.queue.mine:  # 0: our key went with our lease
                self._check_slots(request, turn.queue)
                if turn.queue.ahead < request.slots:
                    slot = self.claim_slot(prefix, lease_id, request.slots)
                    lease = EtcdLease(
                        self, lease_id, slot, turn.queue.mine, turn.kept, ttl, request.ttl
                    )
                    if waited:  # `status` should date the holder from now, not from its wait
                        granted = request.holder._replace(since=time.time())
                        lease.rewrite = (key, _record(request, lease_id, granted))
                    return lease
                waited = True
                pause = _pause(deadline, turn.kept + request.ttl / 3)
                if pause is None:
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
        slots = request.slots
        if turn.stale:
            turn.queue, turn.stale = self.look(prefix, key, slots), False
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
            turn.queue = self.look(prefix, key, slots)
        if moved and slots == 1:
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
        return turn.queue.next_in_line() and now() < turn.kept + _SURE * request.ttl

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
        """Watch what must go for our turn: the key just before ours, or any key of N's queue.

        From the look's revision on, so nothing that happened since is missed. None where
        there is nothing to watch (the key before ours went meanwhile): look again.
        """
        if slots == 1 and not queue.before:
            return None
        key, end = (queue.before, b"") if slots == 1 else queue_range(prefix)
        watch = self.gateway.watch()
        self._watching = watch
        try:
            watch.start(key, end, queue.revision + 1)
        except Unreachable as err:
            raise self.gateway.unavailable(err) from err
        except Refused as refused:
            raise BackendUnavailable(f"{self.settings.where}: {refused.message}") from None
        return watch

    def look(
        self, prefix: bytes, key: bytes, slots: int, put: tuple[str, int] | None = None
    ) -> Queue:
        """Read the queue around our *key* in one transaction (`look_body`); with *put*, queue it.

        A one-slot waiter asks once more for the key just before its own, the one it watches.
        """
        answer = self.call("/v3/kv/txn", look_body(prefix, key, slots, put))
        try:
            queue = read_look(answer)
        except ValueError:
            raise self.malformed(what="a transaction") from None
        if queue.mine and queue.ahead and slots == 1:
            queue = queue._replace(before=self.just_before(prefix, queue.mine))
        return queue

    def just_before(self, prefix: bytes, created: int) -> bytes:
        """Return the queue key created last before revision *created* (b"" if none)."""
        queue, end = queue_range(prefix)
        body = {
            "key": b64(queue),
            "range_end": b64(end),
            "sort_order": "DESCEND",
            "sort_target": "CREATE",
            "max_create_revision": str(created - 1),
            "limit": "1",
            "keys_only": True,
        }
        kvs = kvs_of(self.call("/v3/kv/range", body)) or []
        return unb64(kvs[0].get("key")) if kvs else b""

    def _check_slots(self, request: Request, queue: Queue) -> None:
        """Refuse a lock whose oldest user asked for another N (78)."""
        owner = queue.owner
        if owner is not None and owner.slots != request.slots:
            raise slots_mismatch(request, owner.slots, owner.holder, self.settings.where)

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

    def rewrite(self, key: bytes, record: str, lease_id: int) -> None:
        """Put *record* in our queue key *key*, if it is still there (best effort)."""
        there = {"target": "LEASE", "key": b64(key), "lease": str(lease_id), "result": "EQUAL"}
        put = {"request_put": {"key": b64(key), "value": b64(record), "lease": str(lease_id)}}
        with contextlib.suppress(BackendUnavailable):
            self.call("/v3/kv/txn", {"compare": [there], "success": [put]})

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

    def malformed(self, what: str) -> BackendUnavailable:
        """Return the one line for an answer that is not what etcd sends."""
        return BackendUnavailable(f"{self.settings.where}: {what} came back malformed")

    def close(self) -> None:
        """Close the connections; leases are revoked by their own `release`."""
        self.gateway.close()


def _record(request: Request, lease_id: int, holder: Holder) -> str:
    """Return the value of our queue key: who we are, and the N we ask for (an `Identity`)."""
    return write_json(
        {
            "token": f"{lease_id:016x}",
            "namespace": request.namespace,
            "name": request.name,
            "slots": request.slots,
            "holder": holder.to_dict(),
        }
    )


def _pause(deadline: float | None, renewal: float) -> float | None:
    """Return how long a waiter may watch before it must act; None once *deadline* passed.

    0 or less: our lease is due for its keep-alive (at *renewal*) first.
    """
    current = now()
    if deadline is not None and deadline <= current:
        return None
    due = renewal - current
    return due if deadline is None else min(due, deadline - current)


class EtcdLease:
    """A slot held while lease *lease_id* lives, kept alive every ttl/3 by the supervisor."""

    fds: tuple[int, ...] = ()
    sessions: tuple[int, ...] = ()  # the lease outlives a connection
    bells: tuple[int, ...] = ()

    def __init__(
        self,
        backend: EtcdBackend,
        lease_id: int,
        slot: int,
        fence: int,
        kept: float,
        server_ttl: int,
        ttl: float,
    ) -> None:
        """Describe the slot held by lease *lease_id*, last kept alive by a call sent at *kept*."""
        self.backend = backend
        self.lease_id = lease_id
        self.slot = slot
        self.fence: int | None = fence
        self.confirmed = kept
        self.ttl: float | None = min(ttl, server_ttl)
        self.released = False
        # Our queue key and the record to put there at the first refresh: the grant of a
        # waiter dates it (`status`), off the hand-over's path.
        self.rewrite: tuple[bytes, str] | None = None

    def refresh(self) -> None:
        """Keep the lease alive for another TTL; `LeaseLost` if etcd no longer has it."""
        sent = now()
        if not self.backend.keep_alive(self.lease_id):
            raise LeaseLost(_GONE)
        self.confirmed = sent
        if self.rewrite is not None:
            key, record = self.rewrite
            self.rewrite = None
            self.backend.rewrite(key, record, self.lease_id)

    @property
    def orphan(self) -> bytes:
        """What the guardian needs to free this lease should lockrun die (`abandon`)."""
        return str(self.lease_id).encode()

    def release(self, hold: float = 0.0) -> bool:  # noqa: ARG002 - no mode offers a window
        """Revoke the lease: our keys go, and the next waiter's watch fires."""
        if self.released:
            return True
        self.released = True
        return self.backend.revoke(self.lease_id)
