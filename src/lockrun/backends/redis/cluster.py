"""Redis Cluster: the node that serves a lock's hash slot, found and followed by redirects.

All keys of a lock share one hash tag (docs/backends.md "Redis"), so one node serves the
whole lock and lockrun needs no map of the cluster: it asks a node it knows and follows
the answer. MOVED: the slot is served elsewhere from now on (a resharding ended, or a
failover). ASK: the slot is migrating and the target has the keys (ASKING, then the
command there, once). TRYAGAIN: the lock's keys are split between the two nodes of a
migration, asked again after a pause. CLUSTERDOWN: the cluster cannot serve the slot now
(a failover under way). A node that does not answer is passed over for the next one known.

A first command sent to a node that does not serve the slot costs one more round trip;
a map of the whole cluster (CLUSTER SLOTS, and redis-py's client with it, which also asks
for COMMAND's 50 kB on start-up) would cost one on every start.

A redirect is followed only to a node the cluster lists: the URI's nodes, and those that
CLUSTER SLOTS names, asked of the node that redirected (itself a listed one) the first time
a redirect names a node not known yet. Connecting sends the password: a MOVED to any other
address (a forged reply, a tampered node) is refused, not followed (docs/security.md).

A cluster primary replicates asynchronously, as a Sentinel-managed one does: what it
grants counts only once a replica has it (`check_durable`, docs/design.md A5).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Final

from redis import exceptions as errors
from redis.crc import key_slot

from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import redis

Address = tuple[str, int]

_HOPS: Final = 6  # redirects and unanswered nodes followed within one call
_PAUSE: Final = 0.02  # s before asking again after TRYAGAIN (a migration moves the keys)


class Unsettled(errors.ConnectionError):
    """The cluster answered, but cannot serve the lock's slot right now.

    A failover or a migration under way: no outage, a waiter waits on (docs/design.md A5).
    """


class NotDurable(errors.ConnectionError):
    """The node answered, but a failover could lose what it grants now (docs/design.md A5)."""


class Unlisted(errors.RedisError):
    """A redirect named a node that the cluster does not list: not followed, no password sent."""


def slot_of(prefix: str) -> int:
    """Return the hash slot of the lock whose keys start with *prefix* (its hash tag's)."""
    return int(key_slot(prefix.encode()))


class Router:
    """Which node serves which slot, as far as the cluster's redirects told us.

    *seeds* are the URI's nodes; *make* returns a client (with its pool) for an address.
    Thread-safe: a lease's renewals and the main thread may share it.
    """

    def __init__(self, seeds: Sequence[Address], make: Callable[[Address], redis.Redis]) -> None:
        """Know *seeds*; make a client per node with *make*, on first use."""
        self.known: list[Address] = list(dict.fromkeys(seeds))
        self._make = make
        self._clients: dict[Address, redis.Redis] = {}
        self._serving: dict[int, Address] = {}
        self._lock = threading.Lock()

    def node(self, slot: int) -> Address:
        """Return the node that serves *slot*, as far as we know (a seed, else)."""
        with self._lock:
            return self._serving.get(slot, self.known[0])

    def client(self, address: Address) -> redis.Redis:
        """Return the client of the node at *address*, made on first use."""
        with self._lock:
            if address not in self._clients:
                self._clients[address] = self._make(address)
            return self._clients[address]

    def moved(self, slot: int, address: Address, connection: Any) -> None:  # noqa: ANN401 - redis-py's Connection
        """Note that *address* serves *slot*, as a MOVED on *connection* said (`vouch`)."""
        self.vouch(address, connection)
        with self._lock:
            self._serving[slot] = address

    def vouch(self, address: Address, connection: Any) -> None:  # noqa: ANN401 - redis-py's Connection
        """Raise `Unlisted` unless *address* is a node the cluster lists.

        Known already, or named by CLUSTER SLOTS, asked on *connection*: that of the node
        that redirected, which is a listed one. Every node it names is known from then on.
        """
        with self._lock:
            if address in self.known:
                return
        asked = (str(connection.host), int(connection.port))
        try:
            connection.send_command("CLUSTER", "SLOTS")
            listed = nodes_in(connection.read_response(), asked)
        except BaseException:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            raise
        with self._lock:
            self.known.extend(node for node in listed if node not in self.known)
            if address in self.known:
                return
        host, port = address
        msg = (
            f"a node of the cluster redirected to {host}:{port}, which the cluster does not "
            f"list (CLUSTER SLOTS of {asked[0]}:{asked[1]}): not followed"
        )
        raise Unlisted(msg)

    def after(self, address: Address) -> Address:
        """Return the known node after *address*: the next to ask when it does not answer."""
        with self._lock:
            if address not in self.known:
                return self.known[0]
            return self.known[(self.known.index(address) + 1) % len(self.known)]

    def run(self, slot: int, attempt: Callable[[Any, bool], Any], *, budget: float) -> Any:  # noqa: ANN401 - a reply
        """Run *attempt(connection, asking)* on the node that serves *slot*; return its reply.

        Follows MOVED and ASK, waits out TRYAGAIN within *budget* seconds, and asks the
        next node known when one does not answer: it answers MOVED if another serves the
        slot. Raise `Unsettled` when a node answered but none could serve the slot (yet),
        or the last connection error when none answered at all.
        """
        deadline = now() + budget
        address, asking, answered = self.node(slot), False, False
        last: Exception | None = None
        hops = 0
        while True:  # once at least, then while hops and time are left
            pool = self.client(address).connection_pool
            connection = _connect(pool)
            if isinstance(connection, Exception):  # no answer: ask the next node
                last, address, asking = connection, self.after(address), False
                hops += 1
            else:
                try:
                    return attempt(connection, asking)
                except (NotDurable, Unsettled):
                    raise
                except (errors.AskError, errors.TryAgainError, errors.ClusterDownError) as err:
                    address, asking = self._redirect(slot, address, err, connection, deadline)
                    answered, last = True, err
                    hops += not isinstance(err, errors.TryAgainError)  # a pause, no hop
                except errors.ConnectionError as err:  # refused or reset: ask the next node
                    connection.disconnect()
                    last, address, asking = err, self.after(address), False
                    hops += 1
                except BaseException:
                    connection.disconnect()  # a reply may still be on its way: never reuse it
                    raise
                finally:
                    pool.release(connection)
            if not _left(hops, deadline):
                break
        if answered:
            msg = f"no node of the cluster could serve this lock within {budget:g}s ({last})"
            raise Unsettled(msg)
        assert last is not None  # noqa: S101 - the loop ran at least once
        raise last

    def _redirect(
        self,
        slot: int,
        address: Address,
        err: Exception,
        connection: Any,  # noqa: ANN401 - redis-py's Connection
        deadline: float,
    ) -> tuple[Address, bool]:
        """Return where to ask next after the cluster's *err* for *slot*, and whether ASKING.

        MOVED: the slot is served there from now on. ASK: ask there, once. TRYAGAIN: ask
        the node that serves the slot again, after a pause (within *deadline*).
        CLUSTERDOWN: raise `Unsettled`. A node the cluster does not list: `Unlisted`
        (`vouch`, asked on *connection*).
        """
        if isinstance(err, errors.AskError):  # MovedError is one too
            redirected = (err.host or address[0], int(err.port))  # "": the node we asked
            if isinstance(err, errors.MovedError):
                self.moved(slot, redirected, connection)
                return redirected, False
            self.vouch(redirected, connection)
            return redirected, True
        if isinstance(err, errors.ClusterDownError):
            msg = f"the cluster cannot serve this lock now: {err}"
            raise Unsettled(msg) from err
        time.sleep(max(0.0, min(_PAUSE, deadline - now())))  # TRYAGAIN: the keys move
        return self.node(slot), False

    def primaries(self) -> list[Address]:
        """Return every primary the cluster names (CLUSTER SLOTS, asked of a node that answers)."""
        last: Exception | None = None
        for address in list(self.known):
            try:
                reply = self.client(address).execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            except (errors.ConnectionError, errors.TimeoutError) as err:
                last = err
                continue
            return primaries_in(reply, address)
        assert last is not None  # noqa: S101 - there is a seed
        raise last

    def close(self) -> None:
        """Drop every node's connections."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
            client.connection_pool.disconnect()


def wait_for_replica(
    connection: Any,  # noqa: ANN401 - redis-py's Connection
    where: str,
    wait_ms: int,
) -> None:
    """Raise `NotDurable` unless a replica of *where* has what was just written (WAIT 1).

    Behind Sentinel and in a Cluster alike, a failover promotes a replica, and
    replication is asynchronous: a write no replica has may be forgotten.
    """
    connection.send_command("WAIT", 1, wait_ms)
    if connection.read_response() == 0:
        msg = (
            f"no replica of {where} acknowledged the lease within {wait_ms}ms; "
            "a failover now could forget it"
        )
        raise NotDurable(msg)


def check_durable(
    connection: Any,  # noqa: ANN401 - redis-py's Connection
    where: str,
    role: Any,  # noqa: ANN401 - ROLE's reply, or the error it got
    myself: Any,  # noqa: ANN401 - CLUSTER MYID's reply, or the error it got
    wait_ms: int,
) -> None:
    """Raise `NotDurable` unless a failover of the node *where* keeps what was just written.

    A replica that has it (WAIT 1) will: the cluster promotes one of the primary's
    replicas. Without a replica in sync, the primary is trusted alone only if the cluster
    marks every replica of it failed (or it has none): any other could be promoted
    without the write.
    """
    for reply in (role, myself):
        if isinstance(reply, Exception):  # refused (an ACL): say so
            raise reply
    if not role or role[0] != "master":
        msg = f"{where} is not a primary (it says {role[:1]})"
        raise NotDurable(msg)
    if role[2]:  # it has replicas: wait until one has what we wrote
        wait_for_replica(connection, where, wait_ms)
        return
    connection.send_command("CLUSTER", "REPLICAS", _text(myself))
    live = live_replicas(connection.read_response())
    if live:
        msg = (
            f"{where} has no replica in sync, but the cluster lists {live} not failed; "
            "a failover could promote one without the lease"
        )
        raise NotDurable(msg)


def primaries_in(reply: Any, asked: Address) -> list[Address]:  # noqa: ANN401 - a raw reply
    """Return the primaries a CLUSTER SLOTS *reply* of the node at *asked* names.

    Each entry is START, END, then the primary's HOST, PORT, ID…, then its replicas'; a
    host of "" is the node asked. An entry lockrun cannot read is left out (another node's
    answer may name it).
    """
    return nodes_in(reply, asked, replicas=False)


def nodes_in(reply: Any, asked: Address, *, replicas: bool = True) -> list[Address]:  # noqa: ANN401 - a raw reply
    """Return the nodes a CLUSTER SLOTS *reply* of the node at *asked* names (`primaries_in`)."""
    found: list[Address] = []
    for entry in reply if isinstance(reply, list) else []:
        nodes = entry[2:] if isinstance(entry, list) else []
        for node in nodes if replicas else nodes[:1]:
            address = _address(node, asked)
            if address is not None:
                found.append(address)
    return list(dict.fromkeys(found))


def _address(node: Any, asked: Address) -> Address | None:  # noqa: ANN401 - a raw reply's entry
    """Return the address of one node of a CLUSTER SLOTS entry, HOST, PORT, ID…; None if unread."""
    if not (isinstance(node, list) and len(node) >= 2):  # noqa: PLR2004 - host, port
        return None
    port = _text(node[1])
    if port.isascii() and port.isdigit() and 0 < int(port) < 65536:  # noqa: PLR2004
        return (_text(node[0]) or asked[0], int(port))
    return None


def _connect(pool: Any) -> Any:  # noqa: ANN401 - redis-py's ConnectionPool and Connection
    """Return a connection of *pool*, or the error that kept it from connecting."""
    try:
        return pool.get_connection()
    except (errors.ConnectionError, errors.TimeoutError, OSError) as err:
        return err


def _left(hops: int, deadline: float) -> bool:
    """Return whether another node may be asked: hops and time are left."""
    return hops < _HOPS and now() < deadline


def live_replicas(reply: Any) -> int:  # noqa: ANN401 - a raw reply
    """Return how many replicas of a CLUSTER REPLICAS *reply* the cluster has not failed.

    Each a CLUSTER NODES line, ID ADDRESS FLAGS …: one lockrun cannot read counts as live.
    """
    lines = reply if isinstance(reply, list) else [reply]
    flags = [_text(line).split(" ")[2:3] for line in lines]
    return sum(not each or "fail" not in each[0].split(",") for each in flags)


def _text(value: Any) -> str:  # noqa: ANN401 - a raw reply's element
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
