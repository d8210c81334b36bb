"""Where each call goes: one server, the primary Sentinel names, or a cluster's node.

`Server` owns the connections: redis-py's client (and pool), the primary's own connection
behind Sentinel, a cluster's `Router`, and the connection a waiter sleeps on. It runs our
scripts where they must run and makes a grant durable where a failover could forget it
(docs/design.md A5).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis import exceptions as errors
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from lockrun.backends import timeout_for
from lockrun.backends.redis import topology, wire
from lockrun.backends.redis.cluster import NotDurable, Router, Unsettled, check_durable, slot_of
from lockrun.backends.redis.replies import Malformed, granted
from lockrun.backends.redis.resp import bound
from lockrun.backends.redis.scripts import ACQUIRE, RENEW, keys_of
from lockrun.backends.redis.topology import SentinelView

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends.redis.scripts import Claim, Script
    from lockrun.backends.redis.uri import Settings
    from lockrun.errors import LockrunError

T = TypeVar("T")


class Server:
    """The connections to a Redis server (or to the primary Sentinel names, or a cluster)."""

    def __init__(self, settings: Settings, ttl: float, note: Callable[[str], None]) -> None:
        """Remember *settings*; connect on first use, with timeouts that fit leases of *ttl*."""
        self.settings = settings
        self.ttl = ttl
        self.note = note
        self._client: redis.Redis | None = None
        self.sentinel: Sentinel | None = None
        self._primary: Any = None  # behind Sentinel: our connection for grants and renewals
        self._primary_lock = threading.Lock()  # the renewal thread and the main one share it
        self._named: tuple[str, int] | None = None  # the primary it was, at the last call
        self.interrupted = False  # set by `interrupt`: every wait ends
        self._sleeping: Any = None  # the connection a waiter sleeps in BLPOP on, if any
        # One connection kept out of the pool for our scripts (`_take`): the pool's checks
        # of a connection on every take cost more than the script's round trip.
        self._kept: Any = None
        self._kept_pid = 0  # the process that made it: a forked child makes its own
        self._keeping = threading.Lock()  # whoever holds it uses _kept; others, the pool
        # A Redis Cluster's nodes, by the slots they serve: from a cluster URI, or once a
        # plain one turns out to name a node of a cluster (`detect_cluster`).
        self.router = Router(settings.cluster, self._node) if settings.cluster else None
        # Whether HELLO said if the server is a cluster's (the URI says so for these)
        self.mode_known = bool(settings.sentinels or settings.cluster)

    @property
    def timeout(self) -> float:
        """How long any one call (connect included) may take."""
        return timeout_for(self.ttl)

    @property
    def alone(self) -> bool:
        """Whether this is one server, known to be no cluster's node and not behind Sentinel."""
        return self.sentinel is None and self.router is None and self.mode_known

    def _options(self) -> dict[str, Any]:
        """Return redis-py's options for every connection: timeouts that fit the ttl.

        Each reply must come whole within the timeout and the size caps of `resp.bound`,
        however the server trickles it.
        """
        return {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "redis_connect_func": bound,
            "decode_responses": True,
            "driver_info": None,  # no CLIENT SETINFO round trips on connect
            # HELLO on connect, whose answer names the connection (topology.identity) and
            # says whether the server is a node of a cluster (detect_cluster)
            "protocol": 3,
            # No maintenance notifications: a pushed MOVING would point later connections
            # (and the password) at any address the server names, past the nodes the
            # cluster lists (docs/security.md, "Security model"), and start a timer thread that
            # takes the signals the supervision loop blocks.
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }

    def _node(self, address: tuple[str, int]) -> redis.Redis:
        """Return a client of the cluster node at *address*, logging in as the URI says."""
        kwargs = {
            key: value
            for key, value in self.settings.kwargs.items()
            if key not in {"host", "port", "db"}
        }
        host, port = address
        return redis.Redis(
            host=host, port=port, **kwargs, **self._options(), retry=Retry(NoBackoff(), 0)
        )

    def client(self) -> redis.Redis:
        """Return the client, made on first use, with timeouts that fit the backend's ttl.

        On a cluster: the client of the first node the URI names (CONFIG GET, CLIENT LIST
        and the like go to the lock's node: `node_client`).
        """
        if self.router is not None:
            return self.router.client(self.router.known[0])
        if self._client is None:
            options = self._options()
            # No hidden retries: a retried BLPOP could outlive the lease (docs/design.md P8);
            # lockrun's own loops decide when to ask again.
            no_retries = Retry(NoBackoff(), 0)
            settings = self.settings
            if settings.sentinels:
                sentinel_options = {
                    key: value for key, value in settings.sentinel_kwargs.items() if value
                }
                sentinel = Sentinel(  # type: ignore[no-untyped-call]
                    settings.sentinels,
                    sentinel_kwargs=options | sentinel_options | {"retry": no_retries},
                    **options,
                )
                self._client = sentinel.master_for(  # type: ignore[no-untyped-call]
                    settings.service, **settings.kwargs, **options, retry=no_retries
                )
                self.sentinel = sentinel
            else:
                self._client = redis.Redis(**settings.kwargs, **options, retry=no_retries)
        return self._client

    def node_client(self, prefix: str) -> redis.Redis:
        """Return the client of the node that holds the lock of *prefix* (on a cluster)."""
        if self.router is not None:
            return self.router.client(self.router.node(slot_of(prefix)))
        return self.client()

    def call(
        self, script: Script[T], claim: Claim, *args: str | int, identify: bool | None = None
    ) -> T:
        """Run one of our scripts for *claim*; return its decoded reply; translate errors.

        With *identify* given, one more argument follows *args*: if true, the CLIENT ID of
        the connection that carries the call (`topology.identity`), else "".

        Behind Sentinel, every write goes to the primary the sentinels name, and a grant
        or a renewal counts only once a replica has it (`_on_the_primary`). A release
        sent to a demoted primary would leave the lease to run out on the new one. On a
        cluster, every call goes to the node that serves the lock's slot, and a grant or
        a renewal counts only once a replica has it too (`_on_the_node`).
        """
        keys = keys_of(claim.prefix)
        argv = [claim.prefix, claim.token, claim.slots, claim.ttl_ms, *args]
        durable = script in {ACQUIRE, RENEW}
        try:
            if self.sentinel is not None and script.name != "status":
                reply = self._on_the_primary(script, keys, argv, durable=durable, identify=identify)
            else:
                reply = None
                if self.router is None:
                    try:
                        reply = self._on_a_pooled_connection(script, keys, argv, identify=identify)
                    except errors.MovedError as moved:  # a node of a cluster that HELLO hid
                        if not self.detect_cluster(None, moved):
                            raise
                if self.router is not None:
                    reply = self._on_the_node(
                        script, keys, argv, durable=durable, identify=identify
                    )
        except wire.REPLY_ERRORS as err:
            raise self.failure(err) from err
        try:
            return script.decode(reply)
        except Malformed:  # not our script's answer: not Redis, or tampered
            raise wire.not_redis(self.settings.where, script.name) from None

    def _on_a_pooled_connection(
        self, script: Script[Any], keys: list[str], argv: list[Any], *, identify: bool | None
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run *script* on a connection of redis-py's pool (which reconnects a closed one)."""
        pool = self.client().connection_pool
        kept = self._keeping.acquire(blocking=False)
        try:
            connection = self._kept_ready(pool) if kept else pool.get_connection()
            try:
                if self.detect_cluster(connection):
                    return None  # the caller asks again, the cluster's way
                if identify is not None:
                    argv = [*argv, topology.identity(connection) if identify else ""]
                return wire.run(connection, script, keys, argv)[0]
            except BaseException:  # a reply may still be on its way: never reuse it
                connection.disconnect()
                raise
            finally:
                if not kept:
                    pool.release(connection)
        finally:
            if kept:
                self._keeping.release()

    def _kept_ready(self, pool: Any) -> Any:  # noqa: ANN401 - redis-py's pool and Connection
        """Return the kept connection, connected and with nothing unread (held `_keeping`).

        What the pool checks on every take, for one system call: a connection that has
        something to read (the server closed it, an idle timeout) is made again.
        """
        if self._kept is None or self._kept_pid != os.getpid():
            # Taken from the pool for good (one a first call used, often); after a fork the
            # parent's is left alone: closing it would end the parent's.
            self._kept, self._kept_pid = pool.get_connection(), os.getpid()
        connection = self._kept
        sock = connection._sock  # noqa: SLF001 - redis-py has no accessor
        if sock is not None and _readable(sock):
            connection.disconnect()
        connection.connect()  # a no-op while connected
        return connection

    def lend(self) -> Any:  # noqa: ANN401 - redis-py's Connection
        """Return a connection for a lease's own use, to give back to the pool after.

        The kept one if no call uses it (a new one is kept for the next call): a holder's
        bell and renewals need no connection of their own beside it.
        """
        pool = self.client().connection_pool
        if self.router is None and self._keeping.acquire(blocking=False):
            try:
                connection = self._kept_ready(pool)
                self._kept = None
                return connection
            finally:
                self._keeping.release()
        return pool.get_connection()

    def detect_cluster(self, connection: Any, moved: Exception | None = None) -> bool:  # noqa: ANN401 - redis-py's Connection
        """Switch to the cluster's ways if a plain URI's server is a node of a Redis Cluster.

        Return whether it switched.

        Its answer to HELLO, on every connect, says so (no round trip of its own); a
        MOVED, where something hid it (`topology.cluster_seed`).
        """
        if self.router is not None or (moved is None and self.mode_known):
            return False
        if moved is None:
            self.mode_known = True  # asked once: the HELLO of later connections agrees
            if not topology.in_cluster_mode(connection):
                return False
        address, uri = topology.cluster_seed(self.settings)
        self.router = Router([address], self._node)
        self.note(f"{self.settings.where} is a node of a Redis Cluster: using it as {uri}")
        return True

    def _on_the_node(
        self,
        script: Script[Any],
        keys: list[str],
        argv: list[Any],
        *,
        durable: bool,
        identify: bool | None,
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run *script* on the cluster node that serves the lock's slot (`Router.run`).

        A grant or a renewal counts only once a replica has it (`check_durable`): a
        cluster promotes a replica when its primary fails, and replication is
        asynchronous.
        """
        assert self.router is not None  # noqa: S101 - only on a cluster
        checks = (("ROLE",), ("CLUSTER", "MYID")) if durable else ()
        wait_ms = max(1, int(self.timeout * 500))

        def attempt(connection: Any, asking: bool) -> Any:  # noqa: ANN401 - a reply
            said = argv
            if identify is not None:
                said = [*argv, topology.identity(connection) if identify else ""]
            replies = wire.run(connection, script, keys, said, *checks, asking=asking)
            if durable and granted(replies[0]):
                role, myself = replies[1:]
                check_durable(
                    connection, f"{connection.host}:{connection.port}", role, myself, wait_ms
                )
            return replies[0]

        return self.router.run(slot_of(argv[0]), attempt, budget=self.timeout * 2)

    def _on_the_primary(
        self,
        script: Script[Any],
        keys: list[str],
        argv: list[Any],
        *,
        durable: bool,
        identify: bool | None,
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run *script* where the sentinels say the primary is; make what it grants *durable*.

        A demoted primary stays writable for seconds after a failover, and one cut off
        with its clients stays writable for as long as the cut lasts: a lease renewed
        there is worth nothing (docs/design.md A5). So the node must be the one
        that most of the sentinels name now, it must call itself a primary, and a grant or
        renewal counts only once a connected replica has it (WAIT), so that promoting that
        replica cannot forget it (`topology.check_primary`).
        """
        view = self.sentinel_view()
        self._named = view.primary
        with self._primary_lock:
            if self._primary is None:  # ours alone: the pool would drop one it did not pick
                self._primary = self.client().connection_pool.make_connection()
            connection = self._primary
            try:
                topology.aim(connection, view.primary)
                if identify is not None:
                    argv = [*argv, topology.identity(connection) if identify else ""]
                reply, role = wire.run(connection, script, keys, argv, ("ROLE",))
                topology.check_primary(
                    connection,
                    view,
                    role,
                    written=durable and granted(reply),
                    service=self.settings.service,
                    wait_ms=max(1, int(self.timeout * 500)),
                )
            except BaseException:
                connection.disconnect()  # a reply may still be on its way: never reuse it
                raise
            return reply

    def sentinel_view(self) -> SentinelView:
        """Return the primary that most of the URI's sentinels name now, and what they know.

        Not redis-py's discovery, which takes the first sentinel that answers, and its
        master list, which names the new primary only once a failover has ended.
        """
        assert self.sentinel is not None  # noqa: S101 - only behind Sentinel
        sentinels = self.sentinel.sentinels
        service = self.settings.service
        views = [view for sentinel in sentinels if (view := _ask(sentinel, service))]
        view = topology.majority(views, len(sentinels))
        if view is None:
            msg = f"no majority of the sentinels names a primary for {service!r}"
            raise MasterNotFoundError(msg)
        return view

    def sentinels_answer(self, cause: BaseException | None) -> bool:
        """Return whether *cause* came behind Sentinel while a majority of them answer."""
        if isinstance(cause, NotDurable | Unsettled):
            return True
        if self.sentinel is None:
            return False
        try:
            self.sentinel_view()
        except wire.REPLY_ERRORS:
            return False
        return True

    def failure(self, err: Exception) -> LockrunError:
        """Translate a redis-py error into one line, naming the server but no password."""
        return wire.failure(err, self.settings, self.timeout)

    def every_primary(self) -> list[redis.Redis]:
        """Return a client of the server, or of every primary of a cluster (for SCAN)."""
        if self.router is None and not self.mode_known:
            pool = self.client().connection_pool
            connection = pool.get_connection()  # its HELLO says whether it is a cluster's
            try:
                self.detect_cluster(connection)
            finally:
                pool.release(connection)
        if self.router is None:
            return [self.client()]
        return [self.router.client(address) for address in self.router.primaries()]

    def sleep(self, key: str, seconds: float) -> None:
        """BLPOP *key* for up to *seconds*, on a read timeout just longer than the block.

        On a cluster, a redirect ends the sleep (the wake list is only a hint): the
        waiter asks again, where the slot is now.
        """
        # One server: on the kept connection, which the grant then uses (no second one).
        kept = self.alone and self._keeping.acquire(blocking=False)
        try:
            pool = self.node_client(key).connection_pool
            # may connect again, and fail
            connection = self._kept_ready(pool) if kept else pool.get_connection()
        except wire.REPLY_ERRORS as err:
            if kept:
                self._keeping.release()
            raise self.failure(err) from err
        self._sleeping = connection
        try:
            if self.interrupted:  # before we slept: `interrupt` had nothing to cut
                return
            if self._named is not None:  # behind Sentinel: the wake-up is pushed there
                topology.aim(connection, self._named)
            connection.send_command("BLPOP", key, f"{max(seconds, 0.01):.3f}")
            connection.read_response(timeout=seconds + self.timeout)
        except errors.ResponseError as err:
            if not self._cluster_news(err, key, connection, seconds):
                raise self.failure(err) from err
        except wire.REPLY_ERRORS as err:
            connection.disconnect()
            raise self.failure(err) from err
        except BaseException:
            connection.disconnect()  # a reply may be on its way: never reuse this connection
            raise
        finally:
            self._sleeping = None
            if kept:
                self._keeping.release()
            else:
                pool.release(connection)

    def _cluster_news(
        self,
        err: Exception,
        key: str,
        connection: Any,  # noqa: ANN401 - redis-py's Connection
        seconds: float,
    ) -> bool:
        """Return whether a BLPOP's error *err* is a cluster's news, to ask again after.

        MOVED, ASK, TRYAGAIN (a migration), UNBLOCKED (a failover made the primary a
        replica): the wake list is only a hint, and the next ask goes where the slot is
        served now. CLUSTERDOWN raises: an outage that a waiter rides out.
        """
        if self.router is None:
            return False
        if isinstance(err, errors.ClusterDownError):
            unsettled = Unsettled(f"the cluster cannot serve this lock now: {err}")
            raise self.failure(unsettled) from err
        if isinstance(err, errors.MovedError):
            address = (err.host or connection.host, int(err.port))
            try:
                self.router.moved(slot_of(key), address, connection)
            except wire.REPLY_ERRORS as refused:
                raise self.failure(refused) from refused
        elif isinstance(err, errors.AskError | errors.TryAgainError):
            time.sleep(min(seconds, 0.1))  # mid-migration: not in a tight loop
        return isinstance(err, errors.AskError | errors.TryAgainError) or str(err).startswith(
            "UNBLOCKED"
        )

    def interrupt(self) -> None:
        """From another thread: end a sleep at once, and every later one."""
        self.interrupted = True
        connection = self._sleeping
        sock = getattr(connection, "_sock", None)  # redis-py's socket, if connected
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Drop the connections."""
        if self._kept is not None and self._kept_pid == os.getpid():
            self._kept.disconnect()
        self._kept = None
        if self._primary is not None:
            self._primary.disconnect()
            self._primary = None
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()
            self._client = None
        if self.router is not None:
            self.router.close()


def _readable(sock: socket.socket) -> bool:
    """Return whether *sock* has something to read now (data, or the server's close)."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


def _ask(sentinel: redis.Redis, service: str) -> SentinelView | None:
    """Return what *sentinel* says of *service*; None if it cannot say (`SentinelView.read`).

    Unreachable, it does not know the service, or it is not a sentinel: no view.
    """
    try:
        with sentinel.pipeline(transaction=False) as pipe:
            pipe.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", service)  # type: ignore[no-untyped-call]
            pipe.execute_command("SENTINEL", "MASTER", service)  # type: ignore[no-untyped-call]
            pipe.execute_command("SENTINEL", "REPLICAS", service)  # type: ignore[no-untyped-call]
            address, master, replicas = pipe.execute()
    except wire.REPLY_ERRORS:
        return None
    return SentinelView.read(address, master, replicas)
