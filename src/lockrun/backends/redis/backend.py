"""The Redis backend: queue, wait, lease, leave and report, over our scripts (`scripts`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Final, TypeVar

from redis import exceptions as errors

from lockrun.backends import LockState, Request, slots_mismatch, taken_over_by
from lockrun.backends.redis import topology, wire
from lockrun.backends.redis.leases import DetachedLease, RedisLease
from lockrun.backends.redis.replies import (
    GaveWay,
    Granted,
    Malformed,
    Mismatch,
    Queued,
    Woken,
    clients_of,
    describe,
    gone,
)
from lockrun.backends.redis.resp import within
from lockrun.backends.redis.scripts import (
    ACQUIRE,
    DROP,
    RELEASE,
    RENEW,
    STATUS,
    Claim,
    info_pattern,
    key_prefix,
    keys_of,
)
from lockrun.backends.redis.server import Server
from lockrun.errors import BackendUnavailable, ConfigError, Interrupted, LockrunError, TakenOver
from lockrun.timing import RECONNECT_INTERVAL, now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import redis
    from redis.typing import EncodableT

    from lockrun.backends.redis.replies import Renewed
    from lockrun.backends.redis.scripts import Script
    from lockrun.backends.redis.uri import Settings

T = TypeVar("T")
_DROP_ROUNDS: Final = 8  # dead waiters passed over per release, 1 or more at a time


@contextlib.contextmanager
def _best_effort(*kinds: type[BaseException]) -> Iterator[None]:
    """Give up a best-effort call quietly on *kinds* of failure, never on an interrupt.

    `Interrupted` is a LockrunError too: TERM or INT while waiting must end the wait
    (docs/semantics.md "Signals, the terminal, and time limits").
    """
    try:
        yield
    except Interrupted:
        raise
    except kinds:
        pass


def _mode(request: Request, deadline: float | None) -> str:
    """Return how the acquire script is to ask: try (no wait left), take (--take-over), wait."""
    if deadline is not None and deadline <= now():
        return "try"
    return "take" if request.take_over else "wait"


class RedisBackend:
    """One connection to a Redis server (or to the primary that Sentinel names)."""

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        warn: Callable[[str], None],
        note: Callable[[str], None] | None = None,
    ) -> None:
        """Remember *settings*; *warn* gets one-line warnings (an eviction policy), *note* -v's."""
        self.settings = settings
        self.warn = warn
        self.ttl = ttl
        self.server = Server(settings, ttl, note or (lambda _line: None))
        self._checked = False  # for an eviction policy that could drop our keys

    @property
    def timeout(self) -> float:
        """How long any one call (connect included) may take."""
        return self.server.timeout

    def call(
        self, script: Script[T], claim: Claim, *args: str | int, identify: bool | None = None
    ) -> T:
        """Run one of our scripts for *claim*; return its decoded reply (`Server.call`)."""
        return self.server.call(script, claim, *args, identify=identify)

    def prepare(self, client: redis.Redis) -> None:
        """Before asking: warn once per backend when the server may evict lock keys.

        docs/design.md P25.
        """
        if self._checked:
            return
        try:
            config = client.config_get("maxmemory*")
        except errors.ResponseError:  # managed Redis often forbids CONFIG: nothing to say
            config = {}
        except wire.REPLY_ERRORS as err:
            raise self.server.failure(err) from err
        warning = topology.eviction_warning(self.settings.where, config)
        if warning:
            self.warn(warning)
        self._checked = True

    def acquire(self, request: Request, deadline: float | None) -> RedisLease | None:
        """Queue for a slot and sleep in BLPOP until one is ours, or *deadline* passes."""
        claim = Claim.of(request)
        record = json.dumps(request.holder.to_dict())
        mode = _mode(request, deadline)
        heard: float | None = None  # when the server last answered; None: not yet
        try:
            while True:
                try:
                    self.prepare(self.server.node_client(claim.prefix))
                    sent = now()  # the lease runs from here (ZADD now + ttl on the server)
                    # A waiter names its connection, for releasers to see whether it lives.
                    answer = self.call(ACQUIRE, claim, record, mode, identify=mode != "try")
                    heard = now()
                    if isinstance(answer, Granted):  # no calls for others now: the woken lapse
                        fence = None if request.shared else answer.fence
                        return RedisLease(self, claim, slot=answer.slot, fence=fence, sent=sent)
                    if not self._wait_on(request, claim, answer, mode, deadline):
                        return None  # nothing was queued, or we left the queue
                except BackendUnavailable as err:
                    self._check_interrupted(request)
                    heard = self.ride_out(err, heard, request.ttl, deadline, mode)
                self._check_interrupted(request)
        except TakenOver:
            raise  # the script gave the slot back and left the queue
        except BaseException:
            # Our place in the queue, or a slot granted meanwhile: `leave` has every reply
            # within one timeout in all, so that TERM ends lockrun soon however the server
            # trickles (docs/semantics.md "Signals, the terminal, and time limits").
            self.leave(claim)
            raise

    def _wait_on(
        self,
        request: Request,
        claim: Claim,
        answer: Mismatch | GaveWay | Queued,
        mode: str,
        deadline: float | None,
    ) -> bool:
        """Act on an acquire that granted nothing; return whether to ask again.

        Raise for another N in use, or a slot given back to a taker (nothing is held).
        """
        if isinstance(answer, Mismatch):
            raise self.mismatch(request, claim.prefix, answer.slots)
        self.pass_over_the_dead(claim, answer.woken)
        if isinstance(answer, GaveWay):
            raise TakenOver(taken_over_by(answer.taker))
        if mode == "try":
            return False
        return self.wait_in_line(claim, deadline, answer.lapse_ms, answer.taken_ms)

    def wait_in_line(self, claim: Claim, deadline: float | None, extra: int, taken: int) -> bool:
        """Sleep until our wake list is pushed or *extra* ms pass; False if we gave up instead.

        We give up (and leave the queue) once *deadline* has passed, or at once when the
        lock stays taken for *taken* more ms, beyond it (a --hold-at-least window).
        """
        remaining = None if deadline is None else deadline - now()
        if remaining is not None and (remaining <= 0 or remaining < taken / 1000):
            self.leave(claim)  # busy at once, not after the wait
            return False
        # Bounded sleeps: the wake list is only a hint (docs/design.md D2), and asking
        # again renews our place in the queue, which lapses after a ttl without word.
        block = min(extra / 1000 + 0.002, claim.ttl_ms / 2000)
        if remaining is not None:
            block = min(block, remaining)
        self.server.sleep(f"{claim.prefix}:wake:{claim.token}", block)
        return True

    def interrupt(self) -> None:
        """From another thread: end a waiting `acquire` at once; it raises `Interrupted`.

        Its BLPOP's connection is cut; `acquire` then leaves the queue.
        """
        self.server.interrupt()

    def _check_interrupted(self, request: Request) -> None:
        if self.server.interrupted:
            msg = f"the wait for {request.name} was interrupted; nothing is held"
            raise Interrupted(msg, signo=signal.SIGINT)

    def ride_out(
        self,
        err: BackendUnavailable,
        heard: float | None,
        ttl: float,
        deadline: float | None,
        mode: str,
    ) -> float | None:
        """Pause before asking again after a lost connection while queued; else raise *err*.

        A waiter already in the queue rides out a restart, a failover or a blip for up to a
        ttl (its place may lapse meanwhile; it then queues again). Failing to get in at
        all, or a refusal such as a wrong password, is reported at once (69). A primary
        that answers but cannot make a grant durable yet is no outage: a waiter waits on,
        within --wait; so is a primary that does not answer while a majority of the
        sentinels still do: they are about to promote another. Return when the server (or
        the sentinels) last answered.
        """
        cause = err.__cause__
        transient = isinstance(cause, errors.ConnectionError | errors.TimeoutError) and not (
            isinstance(cause, errors.AuthenticationError | errors.AuthorizationError)
        )
        current = now()
        if mode != "try" and transient and self.server.sentinels_answer(cause):
            heard = current
        if not transient or heard is None or current - heard > ttl:
            raise err
        if deadline is not None and current >= deadline:
            raise err
        time.sleep(min(RECONNECT_INTERVAL, ttl / 10))
        return heard

    def leave(self, claim: Claim, hold_ms: int = 0, *, own: Any = None) -> bool:  # noqa: ANN401 - redis-py's Connection
        """Give up a slot or a place in the queue; best effort, as both lapse by themselves.

        *hold_ms*: keep a held slot taken that long (--hold-at-least). *own*: a lease's own
        connection (`track`), used for the release if it can be, then given to the pool.
        Return whether the server answered the release. All its replies (again on the
        pool, passing over the dead) come within one call's timeout in all: a slow or
        hostile server cannot hold a finished run, deaf to TERM, for a timeout per call
        (docs/semantics.md "What bounds a call").
        """
        woken: Woken | None = None
        with within(self.timeout):
            if own is not None:
                woken = self._release_on(own, claim, hold_ms)
            with _best_effort(LockrunError):
                if woken is None:  # D3: a release is idempotent, asked again if in doubt
                    woken = self.call(RELEASE, claim, hold_ms)
                self.pass_over_the_dead(claim, woken)
        return woken is not None

    def abandon(self, orphan: bytes) -> None:
        """Free the lease of a lockrun that died (`RedisLease.orphan`), in its guardian.

        Without this a killed holder's slot stayed taken for the rest of its ttl (G5).
        """
        prefix, token, slots, ttl_ms = json.loads(orphan)
        self.leave(Claim(prefix, token, slots, ttl_ms))

    def track(self, claim: Claim) -> tuple[Any, bool]:
        """Take a connection (`Server.lend`) on which Redis pushes writes to *claim*'s stop key.

        Client-side caching's tracking (RESP3), OPTIN: only the key read right after
        CLIENT CACHING yes is tracked, once; each renewal on the connection reads it again.
        Return the connection (None behind Sentinel, on a cluster, or when the server
        refuses: the renewals' cadence remains) and whether the key holds something already.
        """
        if not self.server.alone:
            return None, False
        try:
            pool = self.server.client().connection_pool
            connection: Any = self.server.lend()
        except wire.REPLY_ERRORS:
            return None, False
        replies: list[Any] = []
        try:
            replies = wire.pipeline(connection, *wire.TRACK, ("GET", f"{claim.prefix}:stop"))
        except BaseException as err:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            if not isinstance(err, wire.REPLY_ERRORS):
                pool.release(connection)
                raise
        if not replies or any(isinstance(reply, Exception) for reply in replies):
            pool.release(connection)
            return None, False
        return connection, replies[-1] is not None

    def renew_on(
        self,
        connection: Any,  # noqa: ANN401 - redis-py's Connection
        claim: Claim,
        *,
        track: bool,
    ) -> tuple[Renewed | None, bool]:
        """Run the renew script on a lease's own *connection*, tracking the stop key again.

        Return its reply and whether the server still tracks the key for us. A connection
        lost meanwhile is made again by redis-py (without our bell: renewals remain).
        """
        argv = [claim.prefix, claim.token, claim.slots, claim.ttl_ms]
        after = (*wire.TRACK, ("GET", f"{claim.prefix}:stop")) if track else ()
        try:
            reply, *tracked = wire.run(connection, RENEW, keys_of(claim.prefix), argv, *after)
        except wire.REPLY_ERRORS as err:
            connection.disconnect()
            raise self.server.failure(err) from err
        except BaseException:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            raise
        try:
            renewed = RENEW.decode(reply)
        except Malformed:  # not our script's answer: not Redis, or tampered
            raise wire.not_redis(self.settings.where, RENEW.name) from None
        return renewed, track and not any(isinstance(each, Exception) for each in tracked)

    def _release_on(self, connection: Any, claim: Claim, hold_ms: int) -> Woken | None:  # noqa: ANN401 - redis-py's Connection
        """Release on a lease's own *connection* and end its tracking; give it to the pool.

        Return the woken pairs, or None if the call failed (the caller asks again).
        """
        keys = keys_of(claim.prefix)
        argv = [claim.prefix, claim.token, claim.slots, claim.ttl_ms, hold_ms, 1]
        pool = self.server.client().connection_pool
        woken: Woken | None = None
        try:
            reply, _ = wire.run(connection, RELEASE, keys, argv, ("CLIENT", "TRACKING", "OFF"))
            with contextlib.suppress(Malformed):  # not Redis's: the caller asks again
                woken = RELEASE.decode(reply)
        except wire.REPLY_ERRORS:
            connection.disconnect()  # a reply may still be on its way: never reuse it
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
        return woken

    def pass_over_the_dead(self, claim: Claim, woken: Woken) -> None:
        """Take back the slots just granted to waiters whose connection is gone.

        A waiter killed in the queue would otherwise keep the slot it is granted until its
        place lapses, up to its ttl, while the living wait behind it. The server drops a
        dead process's connection at once; a waiter that lost its connection but lives
        asks again from a new one before it claims the slot, and then only queues again.
        Best effort: where CLIENT LIST is not allowed, or a call fails, the ttl still frees
        the slot.
        """
        if not woken:  # the common case: nobody was woken
            return
        with _best_effort(LockrunError, *wire.REPLY_ERRORS):
            for _ in range(_DROP_ROUNDS):
                ids: list[EncodableT] = list(clients_of(woken))
                if not ids:
                    return
                listed = self.server.node_client(claim.prefix).client_list(client_id=ids)
                dead = gone(woken, {str(entry["id"]) for entry in listed})
                if not dead:
                    return
                woken = self.call(DROP, claim, *dead)

    def mismatch(self, request: Request, prefix: str, slots: int) -> ConfigError:
        """Return the --slots mismatch error, naming a live user of the other N."""
        users = self.status(request.namespace, request.name)
        people = [person for state in users for person in (*state.holders, *state.waiters)]
        return slots_mismatch(request, slots, people[0] if people else None, prefix)

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        if name is not None:
            prefixes = [key_prefix(namespace, name)]
        else:
            try:
                found = {
                    key.removesuffix(":info")
                    for client in self.server.every_primary()
                    for key in client.scan_iter(match=info_pattern(namespace), count=1000)
                }
            except wire.REPLY_ERRORS as err:
                raise self.server.failure(err) from err
            prefixes = sorted(found)
        states = []
        for prefix in prefixes:
            state = self.state(namespace, name, prefix)
            if state is not None:
                states.append(state)
        return states

    def state(self, namespace: str, name: str | None, prefix: str) -> LockState | None:
        """Read one lock's keys in one consistent snapshot; None if nobody holds or waits.

        A *name* asked for by the user is reported even when free.
        """
        return describe(self.call(STATUS, Claim.reading(prefix)), namespace, name, prefix)

    @property
    def where(self) -> str:
        """The URI, with no password: for messages."""
        return self.settings.where

    def place(self) -> str:
        """Name the server (or Sentinel service) and database we reach, with no credentials.

        Alike for every spelling of one URI: the default port and database written or not,
        the host in any case, the sentinels in any order (`lockrun.detached`'s tokens).
        """
        kwargs, db = self.settings.kwargs, self.settings.kwargs.get("db", 0)
        if self.settings.sentinels:
            hosts = ",".join(
                sorted(f"{host.lower()}:{port}" for host, port in self.settings.sentinels)
            )
            return f"sentinel {hosts}/{self.settings.service}/{db}"
        if "unix_socket_path" in kwargs:
            return f"unix {os.path.normpath(kwargs['unix_socket_path'])}/{db}"
        if "host" not in kwargs:  # pragma: no cover - a form this code does not know yet
            return f"uri {self.settings.where}"  # as written, without its password
        return f"tcp {str(kwargs['host']).lower()}:{kwargs['port']}/{db}"

    def detached(self, request: Request, hold: float) -> DetachedLease:
        """Return the lease that *request*'s ``lease_id`` names, held by no process.

        *request* is the one `acquire` was given, as its token tells it (no holder); *hold*
        its --hold-at-least.
        """
        return DetachedLease(self, Claim.of(request), math.ceil(hold * 1000))

    def close(self) -> None:
        """Drop the connections."""
        self.server.close()
