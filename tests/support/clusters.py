"""A Redis Cluster of our own: three primaries, a replica each, on free loopback ports.

`Cluster` starts six ``redis-server --cluster-enabled yes`` (tests/support/servers.py's
`RedisServer`, which saves nothing; or another program, such as Valkey's), joins them with
``redis-cli --cluster create --cluster-replicas 1``, and waits until every node says the
cluster is ok and every replica is in sync: about two seconds. It can move a slot to another
primary the way ``redis-cli --cluster reshard`` does (`reshard`: SETSLOT IMPORTING and
MIGRATING, MIGRATE, SETSLOT NODE), fail a primary over to its replica (`failover`: CLUSTER
FAILOVER), and kill one. A node is declared failed after `NODE_TIMEOUT` ms of silence, so
that a killed primary's replica takes over within seconds.
"""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING, Final, NamedTuple

from redis.crc import key_slot

from tests.support.cli import wait_for
from tests.support.servers import REDIS_SERVER, RedisServer, free_port, installed

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

LOOPBACK: Final = "127.0.0.1"
NODE_TIMEOUT: Final = 1000  # ms: cluster-node-timeout
PRIMARIES: Final = 3


class Node(NamedTuple):
    """One line of CLUSTER NODES: who a node is and what it serves."""

    id: str
    port: int
    flags: frozenset[str]
    primary: str  # the id of its primary; "-" for a primary
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        """Whether the node says it is a primary."""
        return "master" in self.flags

    def serves(self, slot: int) -> bool:
        """Whether *slot* is one of the node's ranges."""
        return any(low <= slot <= high for low, high in self.slots)


def slot_of(key: str) -> int:
    """Return the hash slot of *key* (its hash tag's, if it has one)."""
    return int(key_slot(key.encode()))


class Cluster:
    """Three primaries and three replicas on loopback; `close` stops them all."""

    def __init__(self, *, tls: Path | None = None, program: str = REDIS_SERVER) -> None:
        """Start the six nodes (each a *program*), join them, wait until all is well.

        With *tls*, a directory of `make_certificates`: clients, replicas and the cluster
        bus speak TLS only (the port is the TLS port; the unix socket stays plain).
        """
        installed("redis-cli")
        self.servers: dict[int, RedisServer] = {}
        self.tls = tls
        secure: tuple[str, ...] = ()
        cli: tuple[str, ...] = ()
        if tls is not None:
            secure = (
                *("--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no"),
                *("--tls-cert-file", str(tls / "server.crt")),
                *("--tls-key-file", str(tls / "server.key")),
                *("--tls-ca-cert-file", str(tls / "ca.crt")),
            )
            cli = ("--tls", "--cacert", str(tls / "ca.crt"))
        try:
            for _ in range(2 * PRIMARIES):
                port = free_port()
                self.servers[port] = RedisServer(
                    *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                    *("--cluster-port", str(free_port())),  # not PORT + 10000, maybe taken
                    *("--cluster-node-timeout", str(NODE_TIMEOUT)),
                    *("--repl-diskless-sync-delay", "0", "--protected-mode", "no"),
                    *(("--port", "0", "--tls-port", str(port), *secure) if tls else ()),
                    port=port,
                    program=program,
                )
            addresses = [f"{LOOPBACK}:{port}" for port in self.servers]
            create = ("redis-cli", *cli, "--cluster", "create", *addresses)
            subprocess.run(
                (*create, "--cluster-replicas", "1", "--cluster-yes"),
                capture_output=True,
                check=True,
                timeout=60,
            )
            self.wait_settled()
        except BaseException:
            self.close()
            raise

    @property
    def uri(self) -> str:
        """The lockrun URI that names every node (rediss+cluster://, checking them, with TLS)."""
        nodes = ",".join(f"{LOOPBACK}:{port}" for port in self.servers)
        if self.tls is None:
            return f"redis+cluster://{nodes}"
        return f"rediss+cluster://{nodes}?ssl_ca_certs={self.tls / 'ca.crt'}"

    def command(self, port: int, *args: str) -> str:
        """Run redis-cli against the node on *port* and return what it printed."""
        return self.servers[port].command(*args)

    def nodes(self, port: int | None = None) -> list[Node]:
        """Return the cluster as the node on *port* (else any that answers) sees it."""
        for asked in [port] if port is not None else list(self.servers):
            try:
                text = self.command(asked, "CLUSTER", "NODES")
            except (subprocess.SubprocessError, OSError):
                continue
            return [_node(line) for line in text.splitlines() if line.strip()]
        return []

    def owner(self, slot: int) -> int:
        """Return the port of the primary that serves *slot*, as the nodes agree."""
        owners = {node.port for node in self.nodes() if node.is_primary and node.serves(slot)}
        assert len(owners) == 1, f"slot {slot} has owners {owners}"
        return owners.pop()

    def replica_of(self, port: int) -> int:
        """Return the port of the replica of the primary on *port*."""
        nodes = self.nodes()
        (primary,) = (node for node in nodes if node.port == port)
        (replica,) = (node for node in nodes if node.primary == primary.id)
        return replica.port

    def other_primary(self, port: int) -> int:
        """Return the port of a primary other than the one on *port*."""
        return next(node.port for node in self.nodes() if node.is_primary and node.port != port)

    def settled(self) -> bool:
        """Whether every live node says the cluster is ok, agrees on it, and replicas sync."""
        views = set()
        for port, server in self.servers.items():
            if server.process is None:
                continue
            try:
                info = self.command(port, "CLUSTER", "INFO")
                replication = self.command(port, "INFO", "replication")
            except (subprocess.SubprocessError, OSError):
                return False
            if "cluster_state:ok" not in info:
                return False
            if "role:slave" in replication and "master_link_status:up" not in replication:
                return False
            views.add(tuple(sorted((n.port, n.slots) for n in self.nodes(port) if n.is_primary)))
        return len(views) == 1

    def wait_settled(self, timeout: float = 30) -> None:
        """Wait until the cluster is ok everywhere and every node sees the same primaries."""
        wait_for(self.settled, timeout, "the cluster to settle")

    def reshard(self, slot: int, to: int) -> None:
        """Move *slot*, and its keys, to the primary on *to*, as redis-cli --cluster reshard.

        The keys move a few at a time (MIGRATE … KEYS); a client meets ASK and TRYAGAIN
        meanwhile, and MOVED once every node knows the new owner.
        """
        source = self.owner(slot)
        ids = {node.port: node.id for node in self.nodes()}
        self.command(to, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source])
        self.command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[to])
        while keys := self.command(source, "CLUSTER", "GETKEYSINSLOT", str(slot), "3").split():
            self.command(
                source,
                *("MIGRATE", LOOPBACK, str(to), "", "0", "5000", "REPLACE", "KEYS", *keys),
            )
        for port in (to, source, *(p for p in ids if p not in {to, source})):
            if self.servers[port].process is not None:
                self.command(port, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[to])
        wait_for(lambda: self.owner(slot) == to, 10, f"every node to name {to} for slot {slot}")

    def failover(self, replica: int, *, force: bool = False) -> None:
        """CLUSTER FAILOVER on the replica on *replica*; return once the nodes agree on it.

        Without *force*, the primary hands over: the replica has all it wrote first.
        """
        self.command(replica, "CLUSTER", "FAILOVER", *(["FORCE"] if force else []))
        wait_for(
            lambda: any(n.port == replica and n.is_primary for n in self.nodes()),
            30,
            f"{replica} to be promoted",
        )

    def kill(self, port: int) -> None:
        """SIGKILL the node on *port* (a cluster node restarted would keep its identity)."""
        self.servers[port].stop()

    def logs(self, ports: Sequence[int] = ()) -> str:
        """Return the nodes' logs (of *ports*, or all), for a failure's message."""
        return "\n".join(
            f"--- {port}\n{self.servers[port].log()}" for port in ports or list(self.servers)
        )

    def close(self) -> None:
        """Stop every node and remove its directory."""
        for server in self.servers.values():
            server.close()


def _node(line: str) -> Node:
    """Parse one line of CLUSTER NODES."""
    fields = line.split()
    node_id, address, flags, primary = fields[:4]
    port = int(address.split("@")[0].rsplit(":", 1)[1])
    slots = []
    for item in fields[8:]:
        if item.startswith("["):  # a slot being migrated or imported
            continue
        low, _, high = item.partition("-")
        slots.append((int(low), int(high or low)))
    return Node(node_id, port, frozenset(flags.split(",")), primary, tuple(slots))
