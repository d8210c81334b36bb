"""The leases on Redis: a process's (`RedisLease`) and one held by no process (`DetachedLease`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import threading
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from lockrun.backends import taken_over_by
from lockrun.backends.redis import wire
from lockrun.backends.redis.replies import SHARED, window_left
from lockrun.backends.redis.scripts import RELEASE, RENEW, STATUS, Claim
from lockrun.errors import LeaseLost, TakenOver

if TYPE_CHECKING:
    from lockrun.backends.redis.backend import RedisBackend
    from lockrun.backends.redis.replies import Renewed

_GONE: Final = (
    "no lease for this token: it expired (nobody renewed it within its --ttl), was "
    "released, or Redis lost it (FLUSHALL, eviction, a restart or failover)"
)


class RedisLease:
    """A slot held in Redis until its lease, renewed every ttl/3 by the supervisor, ends.

    Asked for its `bells`, it takes a connection for its own (`Server.lend`) and has Redis
    track the lock's stop key on it (`RedisBackend.track`): a take-over request then makes
    Redis push a message on that connection. A thread of the lease's reads what arrives
    between two calls of ours and rings the bell (an eventfd); the socket itself cannot be
    the bell, since the answer to every renewal would ring it. The renewals run on that
    connection and track the key again, in their one round trip.
    """

    fds: tuple[int, ...] = ()
    sessions: tuple[int, ...] = ()  # the lease outlives a connection

    def __init__(
        self, backend: RedisBackend, claim: Claim, *, slot: int, fence: int | None, sent: float
    ) -> None:
        """Describe the slot *claim* holds, granted by a call *sent* then."""
        self.backend = backend
        self.claim = claim
        self.slot = slot
        self.fence = fence
        self.confirmed = sent
        self.ttl: float | None = claim.ttl_ms / 1000
        self.released = False
        self._using = threading.Lock()  # the renewals, `Lock.check` and the bell share _own
        self._own: Any = None  # our connection, tracking the stop key, once bells were asked
        # Until the server refuses CLIENT TRACKING (an ACL, Redis < 6). Only a lone holder
        # has a bell: the release's write that ends the tracking would ring every other
        # reader or slot holder (a renewal each, per release), and their entries in Redis's
        # tracking table would pile up for as long as the lock is never left alone.
        self._tracking = claim.slots == 1 and not claim.token.startswith(SHARED)
        self._bell: int | None = None  # an eventfd: readable when Redis pushed something
        self._quit: int | None = None  # an eventfd that ends the listening thread
        self._listener: threading.Thread | None = None

    @property
    def bells(self) -> tuple[int, ...]:
        """An eventfd that turns readable when Redis pushes a write to the lock's stop key.

        The first call takes the connection and arms it (one round trip). None for a
        reader or a slot of N > 1, behind Sentinel, whose primary connection is shared and
        re-aimed, on a cluster, whose slot may move to another node, nor where the server
        refuses tracking: renewals every ttl/3 still see a take-over.
        """
        with self._using:
            if self._bell is None and self._tracking and not self.released:
                self._own, asked = self.backend.track(self.claim)
                self._tracking = self._own is not None
                if self._tracking:
                    # rung already if a take-over may have been asked before we listened
                    self._bell = os.eventfd(int(asked), os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    self._quit = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    self._listen()
            return () if self._bell is None else (self._bell,)

    def _listen(self) -> None:
        """Start the thread that rings the bell, with every signal blocked.

        The supervisor waits for its signals with them blocked (sigtimedwait): a thread
        that left one unblocked could be handed it, or killed by it.
        """
        thread = threading.Thread(target=self._ring, name="lockrun-redis-bell", daemon=True)
        saved = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, saved)
        self._listener = thread

    def _ring(self) -> None:
        """Ring the bell for each message Redis pushes while none of our calls is under way.

        Ends when the lease is released or the connection lost (the next renewal makes a
        new one and listens again).
        """
        poll = select.poll()
        assert self._quit is not None  # noqa: S101 - set before the thread starts
        poll.register(self._quit, select.POLLIN)
        watched = -1
        while True:
            with self._using:  # a call of ours under way reads its own answer first
                own = self._own
                sock = getattr(own, "_sock", None)
                if own is None or sock is None or self._bell is None:
                    return
                if _pushed(own):
                    os.eventfd_write(self._bell, 1)
                    continue
                watched = _watch(poll, watched, sock.fileno())
            if any(fd == self._quit for fd, _ in poll.poll()):
                return

    def refresh(self) -> None:
        """Extend the lease by a ttl; `LeaseLost` if it ended or Redis lost it.

        `TakenOver` (with the lease extended) while another acquirer asks for a take-over.
        """
        with self._using:
            if self._own is None:
                renewed = self.backend.call(RENEW, self.claim)
            else:
                if self._bell is not None:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._bell)  # heard: this renewal answers it
                renewed, self._tracking = self.backend.renew_on(
                    self._own, self.claim, track=self._tracking
                )
                if self._tracking and not (self._listener and self._listener.is_alive()):
                    self._listen()  # the connection was made again
        if renewed is None:
            msg = (
                "the Redis lease is gone (expired, evicted, FLUSHALL, or a restart or failover "
                "that lost it)"
            )
            raise LeaseLost(msg)
        if renewed.taker is not None:
            raise TakenOver(taken_over_by(renewed.taker))

    @property
    def orphan(self) -> bytes:
        """What the guardian needs to free this lease should lockrun die (`abandon`)."""
        return json.dumps(list(self.claim)).encode()

    def release(self, hold: float = 0.0) -> bool:
        """Give the slot back and wake the next waiter; silent if the lease was lost.

        With *hold*, keep it taken until the server's clock is *hold* seconds on
        (--hold-at-least): nothing of ours keeps running for that. Return whether the
        server answered.
        """
        with self._using:
            if self.released:
                return True
            self.released = True
            own, self._own = self._own, None
            if self._quit is not None:
                os.eventfd_write(self._quit, 1)
        # The listening thread touches the connection only under _using and while _own is
        # it: it can no longer, so the release goes out now and the thread is joined after,
        # off the hand-over's path.
        hold_ms = math.ceil(hold * 1000) if hold > 0 else 0
        try:
            return self.backend.leave(self.claim, hold_ms, own=own)
        finally:
            if self._listener is not None:
                self._listener.join()
            for fd in (self._bell, self._quit):
                if fd is not None:
                    os.close(fd)
            self._bell = self._quit = None


def _pushed(connection: Any) -> bool:  # noqa: ANN401 - redis-py's Connection
    """Read what Redis pushed on *connection*, if anything; return whether it did.

    A connection that fails is dropped, and counts as pushed: a renewal finds out what
    happened, on a new one.
    """
    try:
        pushed = connection.can_read(timeout=0)
        if pushed:
            connection.read_response(push_request=True)
    except wire.REPLY_ERRORS:
        connection.disconnect()
        return True
    return bool(pushed)


def _watch(poll: select.poll, watched: int, fileno: int) -> int:
    """Have *poll* watch *fileno* instead of *watched* (a new connection); return it."""
    if fileno != watched:
        if watched >= 0:
            poll.unregister(watched)
        poll.register(fileno, select.POLLIN)
    return fileno


class DetachedLease(NamedTuple):
    """A lease held by no process (acquire --no-keeper), as any later process finds it.

    Its renewals and its release are the scripts a holder's would be: only the token
    is another process's.
    """

    backend: RedisBackend
    claim: Claim
    hold_ms: int  # --hold-at-least, counted from the grant on the server's clock

    def renew(self) -> None:
        """Extend the lease by its ttl; `LeaseLost` if it is gone.

        A take-over that waits is told here, as a holder's renewal is told: the lease is
        released at once, for the taker, and `TakenOver` says who it is.
        """
        renewed = self._renewed()
        if renewed.taker is not None:
            self.backend.leave(self.claim)  # best effort: otherwise it lapses within a ttl
            msg = f"{taken_over_by(renewed.taker)}; released it"
            raise TakenOver(msg)

    def release(self) -> tuple[str | None, float]:
        """Release, leaving the --hold-at-least window; `LeaseLost` if it was gone already.

        Proved held by a renewal first, as the release script is silent about a lease
        that lapsed: then 0 means held until the release. Return the record of a taker that
        waited (it runs next, and no window is left), else None, and the seconds of window
        left.
        """
        taker = self._renewed().taker
        hold_ms = 0
        if self.hold_ms and taker is None:
            snapshot = self.backend.call(STATUS, Claim.reading(self.claim.prefix))
            hold_ms = window_left(snapshot, self.claim.token, self.hold_ms)
        woken = self.backend.call(RELEASE, self.claim, hold_ms)
        self.backend.pass_over_the_dead(self.claim, woken)
        return taker, hold_ms / 1000

    def _renewed(self) -> Renewed:
        """Renew once; `LeaseLost` if the lease is gone."""
        renewed = self.backend.call(RENEW, self.claim)
        if renewed is None:
            raise LeaseLost(_GONE)
        return renewed
