"""Redis behind Sentinel for the failover tests: two nodes, three sentinels, and a partition.

`SentinelSet` starts a primary, a replica of it and three sentinels that watch it (quorum
2, down after a second), and can fail the primary over on request. With a `Namespace`,
the primary runs in a network namespace of its own, behind a veth pair that `cut` takes
down: the primary (and whatever else runs in there, such as a lock holder) on one side of
a partition, the replica and the sentinels on the other. `UnixOracle` is the oracle of
tests/chaos/oracle.py on a unix socket, which a command in the namespace reaches too (a
filesystem socket belongs to no network namespace).

Everything on the root side says it is at 127.0.0.1 (`replica-announce-ip`, `sentinel
announce-ip`): the veth address may stop being reachable while the link is down, and the
sentinels must still find each other and the replica then.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Final

import pytest
import redis

from tests.support.cli import wait_for
from tests.support.oracle import Oracle
from tests.support.servers import (
    REDIS_SERVER,
    RedisServer,
    _Server,
    free_port,
    installed,
    unavailable,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

SERVICE: Final = "mymaster"
LOOPBACK: Final = "127.0.0.1"
_NUMBERS = itertools.count()  # namespaces, veths and subnets unique within this process

# Both nodes: a replica syncs at once (not after diskless sync's 5 s delay); the replica
# says where we reach it, not where the primary saw it connect from (the veth's end).
_NODE: Final = (
    "--repl-diskless-sync-delay",
    "0",
    "--protected-mode",
    "no",
    "--replica-announce-ip",
    LOOPBACK,
)

# `UnixOracle`'s command: SOCKET TAG HOLD (seconds, or None: until released).
_REPORTER: Final = """
import os, socket, sys
path, tag, hold = sys.argv[1:]
oracle = socket.socket(socket.AF_UNIX)
try:
    oracle.connect(path)
except OSError:
    sys.exit(99)
fence, slot = os.environ.get("LOCKRUN_FENCE", "0"), os.environ.get("LOCKRUN_SLOT", "-1")
oracle.sendall(f"{os.getpid()} {os.getppid()} {fence} {slot} {tag}\\n".encode())
oracle.settimeout(None if hold == "None" else float(hold))
try:
    oracle.recv(16)
except TimeoutError:
    pass
"""


class Namespace:
    """A network namespace joined to ours by a veth pair: `outer` here, `inner` in there.

    Its name, its links and its /30 subnet (10.X.Y.Z, from our pid) are unique per process
    and per instance, so that xdist workers do not collide. `close` deletes it, and the
    pair with it.
    """

    def __init__(self) -> None:
        """Make the namespace and the pair, address both ends and bring them up."""
        if os.geteuid() != 0:
            unavailable("network namespaces need root")
        self.ip = installed("ip")
        number = next(_NUMBERS)
        pid = os.getpid()
        self.name = f"lockrun-{pid}-{number}"
        self.link = f"lr{pid % 100000}x{number % 100}"  # at most 15 characters
        peer = f"{self.link}p"
        base = ((pid % 16384) << 6 | number % 64) << 2  # a /30 of 10.0.0.0/8
        self.outer = f"10.{base >> 16 & 255}.{base >> 8 & 255}.{(base & 255) + 1}"
        self.inner = f"10.{base >> 16 & 255}.{base >> 8 & 255}.{(base & 255) + 2}"
        self._run("netns", "add", self.name)
        try:
            self._run("link", "add", self.link, "type", "veth", "peer", "name", peer)
            self._run("link", "set", peer, "netns", self.name)
            self._run("addr", "add", f"{self.outer}/30", "dev", self.link)
            self._run("link", "set", self.link, "up")
            self._run("-n", self.name, "addr", "add", f"{self.inner}/30", "dev", peer)
            self._run("-n", self.name, "link", "set", peer, "up")
            self._run("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @property
    def prefix(self) -> tuple[str, ...]:
        """The argv prefix that runs a program in the namespace (ip execs it: same pid)."""
        return (self.ip, "netns", "exec", self.name)

    def cut(self) -> None:
        """Take our end of the pair down: nothing crosses until `heal`."""
        self._run("link", "set", self.link, "down")

    def heal(self) -> None:
        """Bring our end of the pair up again."""
        self._run("link", "set", self.link, "up")

    def close(self) -> None:
        """Delete the namespace (and the pair with it); our end too, if it is still here."""
        subprocess.run((self.ip, "netns", "del", self.name), capture_output=True, check=False)
        subprocess.run((self.ip, "link", "del", self.link), capture_output=True, check=False)

    def _run(self, *args: str) -> None:
        result = subprocess.run(
            (self.ip, *args), capture_output=True, text=True, check=False, timeout=30
        )
        if result.returncode:
            pytest.fail(f"ip {shlex.join(args)}: {result.stderr.strip()}")


class NamespacedRedis(RedisServer):
    """A `RedisServer` that runs in *namespace* (its unix socket still reaches it from here)."""

    def __init__(self, namespace: Namespace, *options: str, port: int = 0) -> None:
        """Start the server in *namespace* with extra *options*."""
        self.namespace = namespace
        super().__init__(*options, port=port)

    def _launch(
        self,
        command: Sequence[str],
        *,
        patience: float,
        pause: float,
        user: str | None = None,
        log: bool = False,
        wait: bool = True,
    ) -> None:
        """Launch *command* in the namespace."""
        super()._launch(
            (*self.namespace.prefix, *command),
            patience=patience,
            pause=pause,
            user=user,
            log=log,
            wait=wait,
        )


class SentinelServer(_Server):
    """One redis-server in sentinel mode, watching *primary*, on a port of its own."""

    LOG = "sentinel.log"

    def __init__(self, primary: tuple[str, int], binds: Sequence[str]) -> None:
        """Write the configuration (Sentinel rewrites it as it learns) and start."""
        self.directory = tempfile.mkdtemp(prefix="lr-sentinel-")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.conf = os.path.join(self.directory, "sentinel.conf")
        with open(self.conf, "w") as conf:
            conf.write(
                f"port {self.port}\n"
                f"bind {' '.join(binds)}\n"
                "protected-mode no\n"
                f"dir {self.directory}\n"
                f"logfile {os.path.join(self.directory, self.LOG)}\n"
                f"sentinel announce-ip {LOOPBACK}\n"
                f"sentinel monitor {SERVICE} {primary[0]} {primary[1]} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
        self.client = redis.Redis(
            LOOPBACK, self.port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True
        )
        self.start()

    def start(self) -> None:
        """Start the sentinel and wait until it answers PING."""
        self._launch((REDIS_SERVER, self.conf, "--sentinel"), patience=10, pause=0.01)

    def ping(self) -> bool:
        """Return whether the sentinel answers PING."""
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def ask(self, *args: str) -> object:
        """Send ``SENTINEL ARGS`` and return the reply (None if the sentinel did not answer)."""
        try:
            return self.client.execute_command("SENTINEL", *args)  # type: ignore[no-untyped-call]
        except redis.RedisError:
            return None

    def named(self) -> tuple[str, int] | None:
        """Return the primary this sentinel names now (None: no answer)."""
        answer = self.ask("GET-MASTER-ADDR-BY-NAME", SERVICE)
        if isinstance(answer, list) and len(answer) == 2:
            return str(answer[0]), int(answer[1])
        return None

    def close(self) -> None:
        """Stop the sentinel, drop our connection and remove its directory."""
        self.client.close()
        super().close()


class SentinelSet:
    """A primary, its replica, and three sentinels watching them; `close` stops them all.

    With *namespace*, the primary runs in it, at its `inner` address; the sentinels also
    listen on the namespace's `outer` address, so that a client in there reaches them.
    """

    def __init__(self, namespace: Namespace | None = None) -> None:
        """Start everything and wait until the sentinels know the replica and each other."""
        self.namespace = namespace
        self.nodes: dict[tuple[str, int], RedisServer] = {}
        self.sentinels: list[SentinelServer] = []
        try:
            host, port = (namespace.inner if namespace else LOOPBACK), free_port()
            if namespace is None:
                primary: RedisServer = RedisServer(*_NODE, port=port)
            else:  # listening on the namespace's loopback too, for a client in there
                primary = NamespacedRedis(namespace, *_NODE, "--bind", host, LOOPBACK, port=port)
            self.nodes[host, port] = primary
            replica = RedisServer(*_NODE, "--replicaof", host, str(port), port=free_port())
            self.nodes[LOOPBACK, replica.port] = replica
            self.wait_replicated(replica)
            binds = (LOOPBACK, namespace.outer) if namespace else (LOOPBACK,)
            for _ in range(3):
                self.sentinels.append(SentinelServer((host, port), binds))
            self.wait_ready()
        except BaseException:
            self.close()
            raise

    def uri(self, host: str = LOOPBACK) -> str:
        """Return the lockrun URI of the set, naming the sentinels by *host*."""
        sentinels = ",".join(f"{host}:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{sentinels}/{SERVICE}"

    @property
    def inner_uri(self) -> str:
        """The URI for a client in the namespace: the sentinels at the veth's `outer` end."""
        assert self.namespace is not None
        return self.uri(self.namespace.outer)

    def named(self) -> tuple[str, int] | None:
        """Return the node a majority of the sentinels name now, if any."""
        votes: dict[tuple[str, int], int] = {}
        for sentinel in self.sentinels:
            if (address := sentinel.named()) is not None:
                votes[address] = votes.get(address, 0) + 1
        return next((address for address, count in votes.items() if count >= 2), None)

    def unanimous(self, address: tuple[str, int]) -> bool:
        """Return whether every sentinel names *address*."""
        return all(sentinel.named() == address for sentinel in self.sentinels)

    def primary_port(self) -> int:
        """Return the port of the primary a majority of the sentinels name."""
        address = self.named()
        assert address is not None, "no majority of the sentinels names a primary"
        return address[1]

    def primary(self) -> RedisServer:
        """Return the node a majority of the sentinels name."""
        address = self.named()
        assert address is not None, "no majority of the sentinels names a primary"
        return self.nodes[address]

    def other(self, address: tuple[str, int]) -> tuple[str, int]:
        """Return the address of the node that is not *address*."""
        (found,) = (node for node in self.nodes if node != address)
        return found

    @staticmethod
    def role(node: RedisServer) -> str:
        """Return what *node* says it is (``master``, ``slave``), or ``""`` without an answer."""
        try:
            return node.command("ROLE").split("\n", 1)[0]
        except (subprocess.SubprocessError, OSError):
            return ""

    @staticmethod
    def link_up(replica: RedisServer) -> bool:
        """Return whether *replica* is connected to its primary and in sync."""
        try:
            return "master_link_status:up" in replica.command("INFO", "replication")
        except (subprocess.SubprocessError, OSError):
            return False

    def wait_replicated(self, replica: RedisServer, timeout: float = 30) -> None:
        """Wait until *replica* is connected to its primary and in sync."""
        wait_for(lambda: self.link_up(replica), timeout, "the replica to sync")

    def wait_ready(self, timeout: float = 30) -> None:
        """Wait until every sentinel names one primary and knows the replica and the others."""
        wait_for(lambda: self.named() is not None, timeout, "a majority to name a primary")
        primary = self.named()

        def ready() -> bool:
            for sentinel in self.sentinels:
                replicas = sentinel.ask("REPLICAS", SERVICE)
                others = sentinel.ask("SENTINELS", SERVICE)
                if not (isinstance(replicas, list) and isinstance(others, list)):
                    return False
                if len(others) != 2 or len(replicas) != 1:
                    return False
                (replica,) = replicas  # redis-py makes each a dict of its fields
                if replica["flags"] != "slave" or sentinel.named() != primary:
                    return False
            return True

        wait_for(ready, timeout, "the sentinels to know the replica and each other")

    def failover(self, timeout: float = 30) -> tuple[str, int]:
        """Fail the primary over (SENTINEL FAILOVER); return the new primary's address.

        It returns once every sentinel names the new primary and that node says it is one.
        """
        old = self.named()
        assert old is not None
        new = self.other(old)
        # -NOGOODSLAVE while a sentinel has not refreshed what it knows of the replica yet.
        wait_for(
            lambda: self.sentinels[0].ask("FAILOVER", SERVICE) is not None, 10, "SENTINEL FAILOVER"
        )
        self.wait_promoted(new, timeout)
        return new

    def wait_promoted(self, address: tuple[str, int], timeout: float = 30) -> None:
        """Wait until every sentinel names *address* and that node says it is a primary."""
        wait_for(
            lambda: self.unanimous(address) and self.role(self.nodes[address]) == "master",
            timeout,
            f"the sentinels to promote {address}",
        )

    def logs(self) -> str:
        """Return every server's log, for a failure's message."""
        return "\n".join(
            f"--- {server.directory}\n{server.log()}"
            for server in [*self.nodes.values(), *self.sentinels]
        )

    def close(self) -> None:
        """Stop every sentinel and node and remove their directories."""
        for server in [*self.sentinels, *self.nodes.values()]:
            server.close()


class UnixOracle(Oracle):
    """The `Oracle`, listening on a unix socket in *directory* instead of a loopback port.

    Its commands are Python, which can speak to a unix socket, where bash cannot; like
    bash's, each connects first thing, says who it is, and holds the socket until `release`
    or its end.
    """

    def __init__(self, directory: str) -> None:
        """Listen on ``DIRECTORY/oracle.sock`` and start the thread."""
        self.path = os.path.join(directory, "oracle.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.path)
        listener.listen(512)
        super().__init__(listener)

    def command(self, tag: str = "", *, hold: float | None = None) -> list[str]:
        """Return the argv of a command that reports to us, then holds (see `Oracle`)."""
        return [sys.executable, "-I", "-S", "-c", _REPORTER, self.path, tag, repr(hold)]

    def close(self) -> None:
        """Stop the thread, close every socket and remove the socket's file."""
        super().close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
