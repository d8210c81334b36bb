"""The leases on etcd: a run's (`EtcdLease`) and one held by no process (`DetachedLease`).

docs/design.md A13 gives what each does to the keys: a refresh is a keep-alive and a read of
the stop keys, a release a revoke, after moving the queue key onto a window's lease
(--hold-at-least) or putting it again for a taker.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Final

from lockrun.backends import taken_over_by, write_json
from lockrun.backends.etcd.queue import Stop, lease_named, lock_prefix, queue_key, stopping
from lockrun.errors import LeaseLost, TakenOver
from lockrun.timing import now

if TYPE_CHECKING:
    from lockrun.backends import Holder, Request
    from lockrun.backends.etcd.backend import EtcdBackend
    from lockrun.backends.etcd.bell import Bell
    from lockrun.backends.etcd.queue import Queue

GONE: Final = (
    "its etcd lease is gone: it expired (nobody kept it alive within its --ttl), was "
    "revoked, or etcd lost it"
)
_NO_LEASE: Final = (
    "no lease for this token: it expired (nobody renewed it within its --ttl), was "
    "released, or etcd lost it"
)
_WINDOW_BIT: Final = 1 << 61  # a detached lease's window lease: its ID with this bit flipped


def lease_for(lease_id: str) -> int:
    """Return the etcd lease ID for a run ("": drawn now) or for a token's *lease_id*.

    63 random bits (etcd's IDs are positive int64s); os.urandom, since secrets loads
    hashlib and with it OpenSSL, a few ms of every run's start-up (#32). A token's id is
    20 hex digits drawn by `acquire --no-keeper`: its first 63 bits.
    """
    bits = int(lease_id[:16], 16) if lease_id else int.from_bytes(os.urandom(8), "big")
    return bits >> 1 or 1


def orphan_of(lease_id: int) -> bytes:
    """Return how the guardian is told lease *lease_id* (`Store.abandon` reads it back)."""
    return str(lease_id).encode()


def window_for(lease_id: int) -> int:
    """Return the ID of the window lease of a lease kept by no process (--no-keeper)."""
    return lease_id ^ _WINDOW_BIT or 1


def record_of(request: Request, lease_id: int, holder: Holder) -> str:
    """Return the value of our queue key: who we are, and the N we ask for (an `Identity`).

    A lease kept by no process (--no-keeper) says so at the top, beside the holder.
    """
    record = {
        "token": f"{lease_id:016x}",
        "namespace": request.namespace,
        "name": request.name,
        "slots": request.slots,
        "holder": holder.to_dict(),
    }
    if request.lease_id:
        record["detached"] = True
    return write_json(record)


class EtcdLease:
    """A slot held while lease *lease_id* lives, kept alive every ttl/3 by the supervisor."""

    fds: tuple[int, ...] = ()
    sessions: tuple[int, ...] = ()  # the lease outlives a connection

    def __init__(
        self,
        backend: EtcdBackend,
        request: Request,
        key: bytes,
        queue: Queue,
        slot: int,
        kept: float,
        server_ttl: int,
    ) -> None:
        """Describe the slot our queue *key* holds for *request*, as the granting *queue* look saw.

        Our lease was last kept alive by a call sent at *kept*; the server gave it *server_ttl*.
        """
        self.backend = backend
        self.request = request
        self.holder = request.holder
        self.key = key
        self.lease_id = lease_named(key)
        self.slot = slot
        self.mine = queue.mine  # our key's create revision: a later request stops us
        self.fence: int | None = None if request.shared else queue.mine
        self.shared = request.shared
        self.confirmed = kept
        self.ttl: float | None = min(request.ttl, server_ttl)
        self.released = False
        self.taken = False  # a refresh said a take-over was asked: the release says so
        self.dated = True  # whether the record on the server dates the grant (`status`)
        self._revision = queue.revision  # the granting look: the bell hears what came after
        self._ring = request.slots == 1  # a take-over may be asked: the lease has a bell
        self._bell: Bell | None = None
        self._using = threading.Lock()  # the bell is made and closed by one thread at a time

    def redate(self, since: float, *, now: bool) -> None:
        """Date our record from the grant at *since*, *now* or off the hand-over's path.

        Off it: at the first refresh, a ttl/3 into the run. A put of our key, which the
        waiter behind us answers with one look. A lease kept by no process states its
        window's end too.
        """
        until = since + self.request.hold if self.request.lease_id and self.request.hold else None
        self.holder = self.holder._replace(since=since, until=until)
        self.dated = False
        if now:
            self._date()

    @property
    def record(self) -> str:
        """The value of our queue key, made when it is put: never on the hand-over's path."""
        return record_of(self.request, self.lease_id, self.holder)

    def _date(self) -> None:
        if not self.dated:
            self.dated = True
            self.backend.touch(self.key, self.record, self.lease_id)

    @property
    def bells(self) -> tuple[int, ...]:
        """An eventfd that turns readable when a take-over may have been asked (`Bell`).

        Made at the first ask (a thread and a watch); none for a slot of N > 1, which no
        taker can ask for (--take-over is one slot).
        """
        with self._using:
            if self._bell is None and self._ring and not self.released:
                from lockrun.backends.etcd.bell import Bell  # noqa: PLC0415 - after the spawn

                prefix = self.key[: self.key.rindex(b"q/")]
                self._bell = Bell(self.backend.gateway, prefix, self._revision)
            return () if self._bell is None else (self._bell.fd,)

    def refresh(self) -> None:
        """Keep the lease alive for another TTL; `LeaseLost` if etcd no longer has it.

        `TakenOver` (the lease kept alive) while a take-over asked after our key waits.
        """
        if self._bell is not None:
            self._bell.heard()
        sent = now()
        if not self.backend.keep_alive(self.lease_id):
            raise LeaseLost(GONE)
        self.confirmed = sent
        self._date()
        if self._ring:
            stop = stopping(self.backend.stops(self.key), self.mine, shared=self.shared)
            if stop is not None:
                self.taken = True
                raise TakenOver(taken_over_by(stop.record))

    @property
    def orphan(self) -> bytes:
        """What the guardian needs to free this lease should lockrun die (`abandon`)."""
        return orphan_of(self.lease_id)

    def release(self, hold: float = 0.0) -> bool:
        """Revoke the lease: our keys go, and the next waiter's watch fires.

        With *hold*, the queue key moves onto a lease of *hold* seconds first (the window,
        --hold-at-least), unless a take-over waits. Taken over, it is put again first, so
        that the waiter behind looks and gives way too (A13).
        """
        with self._using:
            if self.released:
                return True
            self.released = True
            bell, self._bell = self._bell, None
        if self.taken:
            self.backend.touch(self.key, self.record, self.lease_id, writer=not self.shared)
        elif hold > 0:
            until = self.holder._replace(until=time.time() + hold)
            record = record_of(self.request, self.lease_id, until)
            self.backend.leave_window(self.key, self.lease_id, self.mine, hold, record)
        released = self.backend.revoke(self.lease_id)
        if bell is not None:
            bell.close()  # off the hand-over's path
        return released


class DetachedLease:
    """A lease held by no process (acquire --no-keeper), as a later process finds it."""

    def __init__(self, backend: EtcdBackend, request: Request, hold: float) -> None:
        """Find the lease *request*'s ``lease_id`` names; *hold*: its --hold-at-least."""
        self.backend = backend
        self.lease_id = lease_for(request.lease_id)
        prefix = lock_prefix(request.namespace, request.name).encode()
        self.key = queue_key(prefix, self.lease_id)
        self.shared = request.shared
        self.hold = hold

    def renew(self) -> None:
        """Extend the lease by its ttl; `LeaseLost` if it is gone.

        A take-over asked after our key is told here: the lease is released at once, for
        the taker, and `TakenOver` says who it is.
        """
        stop = self._held()
        if stop is not None:
            self._revoke()
            msg = f"{taken_over_by(stop.record)}; released it"
            raise TakenOver(msg)

    def release(self) -> tuple[str | None, float]:
        """Release, leaving the --hold-at-least window; `LeaseLost` if it was gone already.

        Proved held by a keep-alive first: then 0 means held until the release. Return a
        waiting taker's record (it runs next, and no window is left), else None, and the
        seconds of window left.
        """
        stop = self._held()
        left = 0.0
        if stop is None and self.hold > 0:
            window = window_for(self.lease_id)
            left = self.backend.time_to_live(window)
            if left > 0:
                self.backend.move_onto(self.key, self.lease_id, window, writer=not self.shared)
        if stop is not None:
            self._revoke()
        else:
            self.backend.revoke(self.lease_id)
        return (None if stop is None else stop.record), left

    def _held(self) -> Stop | None:
        """Keep the lease alive; `LeaseLost` if it is gone. Return a take-over that stops us."""
        if not self.backend.keep_alive(self.lease_id):
            raise LeaseLost(_NO_LEASE)
        mine, stops = self.backend.created_and_stops(self.key)
        if not mine:
            raise LeaseLost(_NO_LEASE)  # the lease lives, our key went: someone deleted it
        return stopping(stops, mine, shared=self.shared)

    def _revoke(self) -> None:
        """Revoke the lease and its window's, if one was made (best effort: they lapse)."""
        self.backend.revoke(self.lease_id)
        if self.hold > 0:
            self.backend.revoke(window_for(self.lease_id))


__all__ = ["GONE", "DetachedLease", "EtcdLease", "lease_for", "orphan_of", "window_for"]
