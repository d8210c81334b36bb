"""The etcd backend: a lease per acquirer, its queue key ordered by create revision (A13).

docs/design.md A13 gives the algorithm; docs/backends.md "etcd" what is stored.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING, Final, Literal

from lockrun.backends import LockState, Request, slots_mismatch, taken_over_by, write_json
from lockrun.backends.etcd.gateway import (
    Outage,
    Refused,
    Unreachable,
)
from lockrun.backends.etcd.lease import (
    DetachedLease,
    EtcdLease,
    lease_for,
    orphan_of,
    record_of,
    window_for,
)
from lockrun.backends.etcd.queue import (
    Put,
    Queue,
    Turn,
    lock_prefix,
    look_body,
    queue_key,
    queue_range,
    read_look,
    stopping,
)
from lockrun.backends.etcd.store import Store
from lockrun.errors import BackendUnavailable, Interrupted, TakenOver
from lockrun.lease_clock import MARGIN
from lockrun.timing import RECONNECT_INTERVAL, now

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends.etcd.gateway import Watch
    from lockrun.backends.etcd.uri import Settings

# Of a lease's ttl since its last keep-alive was sent, how much it surely still runs on the
# server (A10's deadline: the rest is the reserve against drift and scheduling).
_SURE: Final = 1 - MARGIN
# A waiter keeps its lease alive every ttl/2, as Redis's waiters ask (a holder's every ttl/3,
# the supervisor's): half a lease of reserve is many timeouts (ttl/10), and each renewal is
# two calls of every waiter, ~2.5 ms of etcd's CPU (`python -m bench`, idle waiters).
_KEEP_WAITING: Final = 0.5


class EtcdBackend(Store):
    """The members of one etcd cluster, and this process's leases on it: queue and wait."""

    def __init__(
        self, settings: Settings, ttl: float, timeout: float, note: Callable[[str], None]
    ) -> None:
        """Remember *settings*; nothing is asked until the first call."""
        super().__init__(settings, timeout)
        self.ttl = ttl
        self.note = note
        self.interrupted = threading.Event()  # set by `interrupt`: every wait ends
        self._watching: Watch | None = None  # the watch a wait sleeps on, for `interrupt`

    # -- acquire ---------------------------------------------------------------------------

    def acquire(self, request: Request, deadline: float | None) -> EtcdLease | None:
        """Queue a key on a lease of ours and watch the queue until a slot is ours (A13)."""
        prefix = lock_prefix(request.namespace, request.name).encode()
        while True:
            lease_id = lease_for(request.lease_id)
            sent = now()
            ttl = self.grant(lease_id, request.ttl)
            key = queue_key(prefix, lease_id)
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
        turn = Turn(self._first_look(prefix, key, request, put, deadline), sent)
        waited = False
        try:
            while turn.queue.mine:  # 0: our key went with our lease
                self._check_turn(request, turn.queue, key, record, lease_id)
                if turn.queue.held(request.slots, shared=request.shared):
                    return self._granted(request, turn, key, lease_id, ttl, waited=waited)
                if not waited and request.waiting is not None:
                    request.waiting(orphan_of(lease_id))  # freed should we die waiting
                waited = True
                pause = _pause(deadline, turn.kept + request.ttl * _KEEP_WAITING)
                if pause is None or self._window_outlasts(turn.queue, deadline):
                    return None
                if not self._wait_or_ride_out(
                    turn, prefix, key, lease_id, request, pause, deadline
                ):
                    return False
                self._check_interrupted(request)
            return False
        finally:
            turn.close()

    def _first_look(
        self, prefix: bytes, key: bytes, request: Request, put: Put, deadline: float | None
    ) -> Queue:
        """Queue our key and read the queue around it, riding out an outage once a member answered.

        The put is made once whatever is retried (`look_body`); a server that goes down
        between it and the read of the key we watch finds us queued already: we wait it out
        as any queued waiter would (`ride_out`), within our --wait.
        """
        while True:
            try:
                return self.look(prefix, key, request, put)
            except Outage as err:
                self.ride_out(err, request.ttl, deadline)
                self._check_interrupted(request)

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

    def _wait_or_ride_out(
        self,
        turn: Turn,
        prefix: bytes,
        key: bytes,
        lease_id: int,
        request: Request,
        pause: float,
        deadline: float | None,
    ) -> bool:
        """Wait (`_wait`); when no member answers, ride it out and look again after.

        False: our lease is gone.
        """
        try:
            return self._wait(turn, prefix, key, lease_id, request, pause)
        except Outage as err:
            self.ride_out(err, request.ttl, deadline)
            turn.close()
            turn.stale = True
            return True

    def _granted(
        self, request: Request, turn: Turn, key: bytes, lease_id: int, ttl: int, *, waited: bool
    ) -> EtcdLease:
        """Return the lease of a slot just found ours (a slot key claimed for N > 1).

        One that *waited* dates its record from the grant (`status`), off the hand-over's
        path; one kept by no process at once, with its window's end.
        """
        prefix = key[: key.rindex(b"q/")]
        slot = self.claim_slot(prefix, lease_id, request.slots)
        lease = EtcdLease(self, request, key, turn.queue, slot, turn.kept, ttl)
        if request.lease_id and request.hold > 0:  # --no-keeper's window runs from the grant
            self.grant(window_for(lease_id), request.hold)
        if waited or request.hold > 0:
            lease.redate(time.time(), now=bool(request.lease_id))
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
            return self._keep_waiting(turn, key, lease_id, request)
        watch = self._watch_for(turn, prefix, request)
        moved = "changed" if watch is None else watch.moved(pause)
        if moved == "deleted" and self._surely_head(turn, request):
            turn.queue = turn.queue.head()
        elif moved:
            turn.queue = self.look(prefix, key, request)
        if moved and request.slots == 1:
            turn.close()  # another key may be just before ours now
        return True

    def _keep_waiting(self, turn: Turn, key: bytes, lease_id: int, request: Request) -> bool:
        """Keep a waiter's lease alive; False if it is gone. Ask for a look if one is due.

        Due where nothing we watch would have called for it: a take-over asked after our
        key that moves nothing we watch (a writer behind a reader, which a reader's
        take-over, ``tr/``, leaves holding: A13), or our key gone with our lease alive,
        which the hand-over's short cut would not see. One transaction of three small
        reads, not a whole look; never for N > 1, whose queue no taker joins and whose
        every move is looked at.
        """
        sent = now()
        alive = self.keep_alive(lease_id)
        turn.kept = sent
        if alive and request.slots == 1:
            mine = turn.queue.mine
            created, stops = self.created_and_stops(key)
            turn.stale = created != mine or stopping(stops, mine, shared=request.shared) is not None
        return alive

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

    # -- status ---------------------------------------------------------------------------

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace* (`status`)."""
        from lockrun.backends.etcd import status  # noqa: PLC0415 - a run never reports

        return status.read(self, namespace, name)

    def detached(self, request: Request, hold: float) -> DetachedLease:
        """Return the lease that *request*'s ``lease_id`` names, held by no process."""
        return DetachedLease(self, request, hold)

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
