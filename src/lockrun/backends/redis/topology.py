"""What lies behind a Redis URI: Sentinel's view, a cluster found, durability, eviction.

Every check reads replies any server may have forged: each reads defensively, and says
"none" (or raises) rather than believe what Redis would never answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple

from redis import exceptions as errors

from lockrun.backends.redis.cluster import NotDurable, wait_for_replica
from lockrun.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from lockrun.backends.redis.uri import Settings

Address = tuple[str, int]
_ADDRESS_PARTS: Final = 2  # host, port
_DOWN: Final = frozenset({"s_down", "o_down", "disconnected"})


class SentinelView(NamedTuple):
    """What one sentinel (or a majority of them) says of the service right now."""

    primary: Address
    replicas: int  # those it sees up, linked to their primary or not: any may be promoted
    failing_over: bool

    @classmethod
    def read(cls, address: Any, master: Any, replicas: Any) -> SentinelView | None:  # noqa: ANN401 - raw replies
        """Build a view from the raw replies of GET-MASTER-ADDR-BY-NAME, MASTER and REPLICAS."""
        if not (isinstance(address, (list, tuple)) and len(address) == _ADDRESS_PARTS):
            return None
        host, port = (text(part) for part in address)
        if not (port.isascii() and port.isdigit()):
            return None
        up = 0
        for replica in replicas if isinstance(replicas, (list, tuple)) else []:
            up += not set(field(replica, "flags").split(",")) & _DOWN
        failing_over = "failover_in_progress" in field(master, "flags").split(",")
        return cls((host, int(port)), up, failing_over)


def majority(views: Sequence[SentinelView], sentinels: int) -> SentinelView | None:
    """Return the view of the primary most of *sentinels* name, merged; None if none does.

    Its replicas are the most any of them sees, and a failover under way if any says so.
    """
    for view in views:
        agreeing = [other for other in views if other.primary == view.primary]
        if len(agreeing) * 2 > sentinels:
            return SentinelView(
                view.primary,
                replicas=max(other.replicas for other in agreeing),
                failing_over=any(other.failing_over for other in views),
            )
    return None


def check_primary(
    connection: Any,  # noqa: ANN401 - redis-py's Connection
    view: SentinelView,
    role: Any,  # noqa: ANN401 - ROLE's reply, or the error it got
    *,
    written: bool,
    service: str,
    wait_ms: int,
) -> None:
    """Raise unless the node is a primary and, if we *written*, a failover keeps it.

    A primary without a connected replica is trusted alone only when the sentinels
    see no replica up either: then none can be promoted over it. One that is up but
    does not replicate from this node (yet, or any more) may be promoted without what
    we wrote, or may have been a moment ago: the sentinels name a new primary only
    about a second after they promote it.
    """
    where = f"{view.primary[0]}:{view.primary[1]}"
    if isinstance(role, Exception):  # ROLE refused (an ACL): say so
        raise role
    if not role or role[0] != "master":
        msg = f"{where} is not a primary (it says {role[:1]})"
        raise NotDurable(msg)
    if not written:
        return
    if view.failing_over:
        msg = f"a failover of {service!r} is under way"
        raise NotDurable(msg)
    if role[2]:  # it has replicas: wait until one has what we wrote
        wait_for_replica(connection, where, wait_ms)
    elif view.replicas:
        msg = (
            f"{where} has no replica in sync, but the sentinels see {view.replicas} up; "
            "a failover could promote one without the lease"
        )
        raise NotDurable(msg)


def aim(connection: Any, address: Address) -> None:  # noqa: ANN401 - redis-py's
    """Connect a Sentinel-managed *connection* to *address*, unless it is there and idle.

    Left to itself, redis-py would connect a dropped connection to the primary *it* found,
    not to the one most sentinels name; and a kept connection that the server closed since
    its last use (a restart) would fail the next call.
    """
    if connection.is_connected and (connection.host, int(connection.port or 0)) == address:
        try:
            if not connection.can_read():  # nothing pending, not even the end of the stream
                return
        except (errors.RedisError, OSError):
            pass
    connection.disconnect()
    connection.connect_to(address)


def said(hello: Any, name: str) -> object:  # noqa: ANN401 - HELLO's raw reply
    """Return field *name* of the server's answer to HELLO, or None."""
    return hello.get(name, hello.get(name.encode())) if isinstance(hello, dict) else None


def in_cluster_mode(connection: Any) -> bool:  # noqa: ANN401 - redis-py's Connection
    """Return whether HELLO, on connecting *connection*, said the server is a cluster's node."""
    hello = getattr(connection, "handshake_metadata", None)
    return said(hello, "mode") in {"cluster", b"cluster"}


def identity(connection: Any) -> str:  # noqa: ANN401 - redis-py's Connection
    """Return *connection*'s CLIENT ID, by which a releaser sees that we still wait.

    The server says it in its answer to HELLO, which redis-py sends on every connect:
    no round trip, and a reconnect (ours, or redis-py's after a restart) never leaves
    us naming a connection that is gone. "" where it is not said: our place in the
    queue then lapses a ttl after our death.
    """
    connection.connect()  # no-op if connected
    number = said(connection.handshake_metadata, "id")
    return str(number) if type(number) is int and number > 0 else ""


def cluster_seed(settings: Settings) -> tuple[Address, str]:
    """Return the address of a plain URI's server found to be a cluster's node, and its URI.

    A cluster has database 0 alone, and redirects name TCP addresses: a unix: URI, or
    another database, is refused (78).
    """
    where, kwargs = settings.where, settings.kwargs
    if "unix_socket_path" in kwargs or kwargs.get("db"):
        what = "a unix socket" if "unix_socket_path" in kwargs else f"database {kwargs['db']}"
        msg = (
            f"{where} is a node of a Redis Cluster, which lockrun cannot reach through "
            f"{what}; use redis+cluster://HOST[:PORT],… (database 0)"
        )
        raise ConfigError(msg)
    host, port = address = (str(kwargs["host"]), int(kwargs["port"]))
    scheme = "rediss+cluster" if kwargs.get("ssl") else "redis+cluster"
    shown = f"[{host}]" if ":" in host else host
    return address, f"{scheme}://{shown}:{port}"


def eviction_warning(where: str, config: Mapping[Any, Any]) -> str | None:
    """Return the warning for a server whose CONFIG GET maxmemory* says it may evict keys.

    docs/design.md P25.
    """
    policy = config.get("maxmemory-policy", "noeviction")
    if config.get("maxmemory", "0") != "0" and policy != "noeviction":
        return (
            f"warning: {where} has maxmemory-policy {policy}: under memory "
            "pressure it may evict lock keys and let a second holder in; use noeviction"
        )
    return None


def text(value: Any) -> str:  # noqa: ANN401 - a raw reply's element
    """Return a raw reply's element as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def field(reply: Any, name: str) -> str:  # noqa: ANN401 - a raw reply
    """Return field *name* of a raw Sentinel reply: a map (RESP3) or a flat list (RESP2)."""
    if isinstance(reply, list):  # pairs, not a dict: a key may be a list or a map
        pairs = list(zip(reply[::2], reply[1::2], strict=False))
    elif isinstance(reply, dict):
        pairs = list(reply.items())
    else:
        return ""
    return text(next((value for key, value in pairs if text(key) == name), ""))
