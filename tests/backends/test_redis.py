"""What only Redis does: TLS, replicas, database numbers, eviction, Sentinel, keys, lost leases.

What every backend shares (status, passwords, unreachable servers, bad URIs) is in
tests/contract. Every server here is a real redis-server (or redis-server --sentinel) of the
test's own, on a unix socket or a loopback port.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import unquote

import pytest

from lockrun import ConfigError, ExitCode, Lock, TakenOver
from lockrun.backends import Holder, Request, open_backend, parse_uri, timeout_for
from lockrun.backends.redis import Claim, connect, key_prefix, parse
from lockrun.backends.redis.replies import Granted, Queued
from lockrun.backends.redis.scripts import ACQUIRE
from lockrun.errors import LeaseLost
from lockrun.timing import now
from tests.support.cli import finish, lockrun, one_line, start, wait_for
from tests.support.net import (
    DRIVER_TIMEOUT,
    Listener,
    make_certificates,
    secret_free,
)
from tests.support.proxy import Proxy
from tests.support.sentinels import SentinelServer
from tests.support.servers import RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from lockrun.backends import Backend, Lease

# --ttl 3 makes every Redis connect or answer give up after timeout_for(3) = 1 s (the floor).
SHORT_TTL = "3"
PATIENCE = 30.0  # a hang guard for a thread of ours


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[RedisServer]:
    """Return a plain Redis with a loopback port, shared by this module's tests."""
    server = RedisServer(port=free_port())
    yield server
    server.close()


# -- A. TLS, a replica, a database number ----------------------------------------------------------


def test_a_server_silent_during_the_tls_handshake_exits_69_within_the_ttls_timeout(
    name: str,
) -> None:
    """With rediss:// the silence comes during the TLS handshake, under the connect timeout.

    (Plain silence, on every backend: tests/contract/test_config_unreachable.py.)
    """
    with contextlib.closing(Listener(None)) as listener:
        uri = f"rediss://127.0.0.1:{listener.port}/0"
        args = ("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
        result = lockrun(*args)  # its 60 s: the hang guard
        wait_for(lambda: listener.waited, what="lockrun to hang up")
    assert result.returncode == ExitCode.UNAVAILABLE
    line = one_line(result.stderr)
    assert f"no answer within {timeout_for(float(SHORT_TTL)):g}s" in line
    # The server's clock, from accept to hang-up: lockrun's timeout, no start-up in it.
    assert listener.longest_wait() < DRIVER_TIMEOUT


# Each way: a round trip of 0.3 s, more than --ttl 4 gave an answer before the floor
# (0.2 s), well within the floor (1 s) however loaded the machine.
LAG = 0.15


@pytest.mark.parametrize("busy", [False, True], ids=["free", "busy"])
def test_a_slow_server_is_waited_for_however_short_the_ttl_and_the_wait(
    tcp_server: RedisServer, busy: bool, name: str
) -> None:
    """--ttl 4 --wait 0.05 through a lagging link: the answers count (0 or 75), never 69.

    Neither the ttl nor --wait cuts a connect or an answer below the floor
    (backends.MIN_TIMEOUT): 69 means unreachable, not slow.
    """
    holder = Lock(name, uri=tcp_server.tcp_uri, wait=0)
    with contextlib.closing(Proxy(("127.0.0.1", tcp_server.port))) as proxy:
        proxy.delay(LAG)
        held = holder.acquire() if busy else None
        try:
            result = lockrun("--uri", proxy.uri, "-n", name, "--ttl", "4", "-w", "0.05", "true")
        finally:
            if held is not None:
                held.release()
    assert result.returncode == (ExitCode.BUSY if busy else 0), result.stderr
    if busy:
        assert "busy" in one_line(result.stderr)


def test_the_database_number_is_checked(tcp_server: RedisServer, name: str) -> None:
    """/abc and ?db=x are bad URIs (78); /16 and ?db=99 do not exist on a 16-db server (78)."""
    tcp = f"127.0.0.1:{tcp_server.port}"
    for uri, needle in (
        (f"redis://{tcp}/abc", "'abc' is not a number"),
        (f"{tcp_server.uri}?db=x", "'x' is not a number"),
        (f"redis://{tcp}/16", "no such database"),
        (f"redis://{tcp}/99", "no such database"),
        (f"{tcp_server.uri}?db=99", "no such database"),
    ):
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert result.returncode == ExitCode.CONFIG, uri
        assert needle in one_line(result.stderr)
    result = lockrun("--uri", f"redis://{tcp}/15", "-n", name, "--", "true")
    assert (result.returncode, result.stderr) == (0, "")
    assert (
        tcp_server.command("-n", "15", "KEYS", "lockrun:*") == f"lockrun:{{default/{name}}}:fence"
    )


def test_rediss_to_a_plain_port_exits_69(tcp_server: RedisServer, name: str) -> None:
    """TLS to a server that does not speak it is unavailable (69), one line."""
    uri = f"rediss://127.0.0.1:{tcp_server.port}/0"
    # A client waiting for a TLS answer that never comes would hang: `lockrun`'s 60 s guards
    # that; the timeout itself is measured by the server's clock in the test above.
    result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
    assert result.returncode == ExitCode.UNAVAILABLE
    assert uri in one_line(result.stderr)


def test_tls(tmp_path: Path, name: str) -> None:
    """rediss:// with our CA and client certificate runs; other set-ups exit 69, one line.

    A wrong CA, no CA (the system's), no client certificate, and plain redis:// to the TLS
    port are all unavailable; ssl_cert_reqs=none skips the server's certificate check.
    """
    make_certificates(tmp_path)
    port = free_port()
    try:
        server = RedisServer(
            *("--tls-port", str(port), "--tls-auth-clients", "yes"),
            *("--tls-cert-file", str(tmp_path / "server.crt")),
            *("--tls-key-file", str(tmp_path / "server.key")),
            *("--tls-ca-cert-file", str(tmp_path / "ca.crt")),
        )
    except pytest.fail.Exception as err:
        if "tls" not in str(err).lower():
            raise
        pytest.skip(f"this redis-server has no TLS support: {err}")
    try:
        base = f"rediss://127.0.0.1:{port}/0"
        ca, other = tmp_path / "ca.crt", tmp_path / "other-ca.crt"
        client = f"ssl_certfile={tmp_path}/client.crt&ssl_keyfile={tmp_path}/client.key"
        result = lockrun(
            *("--ttl", SHORT_TTL, "--uri", f"{base}?ssl_ca_certs={ca}&{client}"),
            *("-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE"),
        )
        assert result.returncode == 0, result.stderr
        assert int(result.stdout) > 0
        for uri, needle in (
            (f"{base}?ssl_ca_certs={other}&{client}", "certificate verify failed"),
            (f"{base}?{client}", "certificate verify failed"),
            (f"{base}?ssl_ca_certs={ca}", ""),
            (f"redis://127.0.0.1:{port}/0", ""),
        ):
            result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
            assert result.returncode == ExitCode.UNAVAILABLE, uri
            assert needle in one_line(result.stderr).lower()
        result = lockrun("--uri", f"{base}?ssl_cert_reqs=none&{client}", "-n", name, "--", "true")
        assert (result.returncode, result.stderr) == (0, "")
    finally:
        server.close()


def test_a_read_only_replica_exits_69(name: str) -> None:
    """Pointed at a replica, lockrun says so and exits 69; nothing is written anywhere."""
    master = RedisServer("--repl-diskless-sync-delay", "0", port=free_port())
    replica = None
    try:
        replica = RedisServer("--replicaof", "127.0.0.1", str(master.port))
        connected = replica
        wait_for(
            lambda: "master_link_status:up" in connected.command("INFO", "replication"),
            timeout=10,
            what="the replica to sync",
        )
        result = lockrun("--uri", replica.uri, "-n", name, "--", "echo", "ran")
        assert result.returncode == ExitCode.UNAVAILABLE
        assert result.stdout == ""
        assert "read-only replica" in one_line(result.stderr)
        assert master.command("KEYS", "*") == ""
    finally:
        if replica is not None:
            replica.close()
        master.close()


# -- B. an eviction policy that could drop lock keys -----------------------------------------------


@pytest.mark.parametrize(
    ("maxmemory", "policy", "warns"),
    [
        ("100mb", "allkeys-lru", True),
        ("100mb", "volatile-ttl", True),
        ("100mb", "noeviction", False),
        ("0", "allkeys-lru", False),
    ],
)
def test_an_evicting_server_gets_one_warning(
    redis_server: RedisServer, name: str, maxmemory: str, policy: str, warns: bool
) -> None:
    """With maxmemory and an evicting policy the command runs and stderr has one warning."""
    redis_server.command("CONFIG", "SET", "maxmemory", maxmemory)
    redis_server.command("CONFIG", "SET", "maxmemory-policy", policy)
    result = lockrun("--uri", redis_server.uri, "-n", name, "--", "echo", "ran")
    assert (result.returncode, result.stdout) == (0, "ran\n")
    if warns:
        line = one_line(result.stderr)
        assert f"maxmemory-policy {policy}" in line
        assert "warning" in line
    else:
        assert result.stderr == ""


# -- C. Sentinel -----------------------------------------------------------------------------------


class Watched(NamedTuple):
    """A master with a loopback port, and the port of one sentinel that monitors it."""

    master: RedisServer
    port: int


@pytest.fixture
def sentinel() -> Iterator[Watched]:
    """Return a master and a sentinel that names it, both stopped at teardown."""
    master = RedisServer(port=free_port())
    try:
        watcher = SentinelServer(("127.0.0.1", master.port), ("127.0.0.1",))
    except BaseException:
        master.close()
        raise
    try:
        wait_for(
            lambda: watcher.named() == ("127.0.0.1", master.port), timeout=10, what="the sentinel"
        )
        yield Watched(master, watcher.port)
    finally:
        watcher.close()
        master.close()


def test_sentinel_finds_the_master_and_the_lock_lands_there(sentinel: Watched, name: str) -> None:
    """redis+sentinel://…/mymaster/3 runs the command with a fence kept in db 3 of the master."""
    uri = f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster/3"
    args = ("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    result = lockrun(*args)
    assert (result.returncode, result.stderr) == (0, "")
    fence = int(result.stdout)
    key = f"lockrun:{{default/{name}}}:fence"
    assert sentinel.master.command("-n", "3", "KEYS", "lockrun:*") == key
    assert sentinel.master.command("-n", "3", "GET", key) == str(fence)


def test_a_kept_sentinel_backend_carries_on_after_the_primary_restarts(
    sentinel: Watched, name: str
) -> None:
    """Its own connection to the primary closed by a restart: the next acquisition reconnects."""
    backend = open_backend(parse_uri(f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster"), ttl=3)
    request = Request("default", name, 1, 3.0, Holder.me(["x"]))
    fences: list[int] = []
    try:
        for deadline in (0, None, 0):
            if fences:
                sentinel.master.stop()
                sentinel.master.start()
            fences.append(_fence_of_a_cycle(backend, request, deadline))
    finally:
        backend.close()
    assert fences == sorted(set(fences)), fences


def _fence_of_a_cycle(backend: Backend, request: Request, deadline: float | None) -> int:
    """Acquire and release on *backend*; return the grant's fence."""
    lease = backend.acquire(request, deadline)
    assert lease is not None
    assert lease.fence is not None
    lease.release()
    return lease.fence


def test_the_fleet_modes_behind_sentinel(sentinel: Watched, name: str) -> None:
    """Readers share, a window holds, a take-over stops the holder: on the primary it names.

    No bell behind Sentinel (the primary's connection is shared and re-aimed): the take-over
    is seen by the renewal, whose answer, a taker's record, counts as a renewal made durable.
    """
    uri = f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster"
    readers = [Lock(name, uri=uri, ttl=3, shared=True) for _ in range(2)]
    leases = [reader.acquire() for reader in readers]
    assert [lease.fence for lease in leases] == [None, None]
    for reader in readers:
        reader.release()
    first = lockrun(
        "--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--hold-at-least", "30", "--", "true"
    )
    assert first.returncode == 0, first.stderr
    busy = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
    assert busy.returncode == ExitCode.BUSY
    assert "--hold-at-least" in one_line(busy.stderr)
    other = f"{name}-taken"
    backend = open_backend(parse_uri(uri), ttl=3)
    try:
        lease = backend.acquire(Request("default", other, 1, 3.0, Holder.me(["x"])), 0)
        assert lease is not None
        assert lease.bells == ()
        taker = start(
            "--ttl", SHORT_TTL, "--uri", uri, "-n", other, "--take-over", "-w", "30", "--", "true"
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                lease.refresh()
            except TakenOver:
                break
            assert time.monotonic() < deadline, "the renewal never saw the take-over"
            time.sleep(0.1)
        lease.release()
        assert finish(taker) == 0
    finally:
        backend.close()


def test_sentinel_with_an_unknown_service_exits_69(sentinel: Watched, name: str) -> None:
    """A service the sentinels do not monitor is unavailable (69), one line naming it."""
    uri = f"redis+sentinel://127.0.0.1:{sentinel.port}/nosuch"
    result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
    assert result.returncode == ExitCode.UNAVAILABLE
    assert "nosuch" in one_line(result.stderr)


@pytest.mark.parametrize("silent", [False, True], ids=["refused", "silent"])
def test_sentinels_that_do_not_answer_exit_69_within_the_ttls_timeout(
    silent: bool, name: str
) -> None:
    """No sentinel answers: 69 after one timeout per ask, not after redis-py's retries.

    Renewals reconnect through the sentinels too, so their calls must stay within the
    timeouts the lease's safety margin is built on, like direct connections. lockrun asks
    the silent sentinel twice (for the primary, then whether a majority answers after the
    failure, `_sentinels_answer`), one connection each: a retry would be more of them.
    Counted, not timed: the two timeouts and start-up took 2.05 s beyond a baseline here at
    load average 40, over the 2 s this test allowed.
    """
    with contextlib.closing(Listener(None)) as listener:
        port = listener.port if silent else free_port()
        uri = f"redis+sentinel://127.0.0.1:{port}/mymaster"
        result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
        connections = len(listener.kept)
    assert result.returncode == ExitCode.UNAVAILABLE
    one_line(result.stderr)
    assert connections <= (2 if silent else 0), "redis-py retried the sentinel"


def test_no_sentinel_answering_gives_a_readable_line(name: str) -> None:
    """The line for unreachable sentinels names them, without client internals or passwords."""
    uri = (
        f"redis+sentinel://:pw-master@127.0.0.1:{free_port()}/mymaster"
        "?sentinel_password=pw-sentinel"
    )
    result = lockrun("--ttl", SHORT_TTL, "--uri", uri, "-n", name, "--", "true")
    assert result.returncode == ExitCode.UNAVAILABLE
    line = one_line(result.stderr)
    secret_free(result, "pw-master", "pw-sentinel")
    assert "mymaster" in line
    assert "<redis." not in line, "the message carries redis-py's repr of its client"


# -- D. URI parsing and key names, in process ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://", {"host": "localhost", "port": 6379, "db": 0, "password": None}),
        ("redis://cache.internal", {"host": "cache.internal", "port": 6379, "db": 0}),
        ("redis://127.0.0.1:6380/2", {"host": "127.0.0.1", "port": 6380, "db": 2}),
        ("redis://[::1]:6380", {"host": "::1", "port": 6380, "db": 0}),
        ("redis://[::1]/4", {"host": "::1", "port": 6379, "db": 4}),
        ("redis://h?db=5", {"host": "h", "db": 5}),
        ("redis://alice:pw@h", {"username": "alice", "password": "pw"}),
        ("redis://:pw@h", {"username": None, "password": "pw"}),
        ("redis://u%40corp:p%3Aw%2Fd%40x@h", {"username": "u@corp", "password": "p:w/d@x"}),
        ("unix:///run/redis.sock", {"unix_socket_path": "/run/redis.sock", "db": 0}),
        (
            "unix:///run/redis.sock?db=3&username=u&password=p",
            {"unix_socket_path": "/run/redis.sock", "db": 3, "username": "u", "password": "p"},
        ),
    ],
)
def test_parse_maps_uris_to_redis_py_settings(text: str, expected: dict[str, object]) -> None:
    """Defaults, IPv6, db from the path or ?db=, unix sockets and %-decoded credentials."""
    settings = parse(parse_uri(text))
    assert {key: settings.kwargs.get(key) for key in expected} == expected
    assert not settings.kwargs.get("ssl")
    assert settings.sentinels == ()
    assert "pw" not in settings.where.replace("//", "")


def test_parse_maps_tls_options_to_redis_py(tmp_path: Path) -> None:
    """rediss:// turns on TLS and hands each ssl_* option to redis-py, typed as it expects."""
    for pem in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / pem).write_text("")
    query = (
        f"ssl_ca_certs={tmp_path}/ca.pem&ssl_certfile={tmp_path}/c.pem"
        f"&ssl_keyfile={tmp_path}/k.pem&ssl_cert_reqs=optional&ssl_check_hostname=false"
    )
    settings = parse(parse_uri(f"rediss://h:6390/1?{query}"))
    assert dict(settings.kwargs) == {
        "host": "h",
        "port": 6390,
        "db": 1,
        "username": None,
        "password": None,
        "ssl": True,
        "ssl_ca_certs": f"{tmp_path}/ca.pem",
        "ssl_certfile": f"{tmp_path}/c.pem",
        "ssl_keyfile": f"{tmp_path}/k.pem",
        "ssl_cert_reqs": "optional",
        "ssl_check_hostname": False,
    }
    assert parse(parse_uri("rediss://h?ssl_check_hostname=yes")).kwargs["ssl_check_hostname"]
    assert parse(parse_uri("rediss://h")).kwargs["ssl"] is True


def test_parse_sentinel_uris() -> None:
    """Sentinel hosts (default port 26379, IPv6 too), the service, then the db; both passwords."""
    settings = parse(
        parse_uri("redis+sentinel://:pw@a,b:26380,[::1]/mymaster/2?sentinel_password=sp")
    )
    assert settings.sentinels == (("a", 26379), ("b", 26380), ("::1", 26379))
    assert settings.service == "mymaster"
    assert (settings.kwargs["db"], settings.kwargs["password"]) == (2, "pw")
    assert dict(settings.sentinel_kwargs) == {"username": None, "password": "sp"}
    assert "pw" not in settings.where.replace("//", "")
    assert "sp" not in settings.where
    assert parse(parse_uri("redis+sentinel://s/svc")).kwargs["db"] == 0
    assert parse(parse_uri("redis+sentinel://s/svc?db=7")).kwargs["db"] == 7


def test_parse_cluster_uris(tmp_path: Path) -> None:
    """Cluster nodes (default port 6379, IPv6 too), no database but 0, TLS for rediss+cluster."""
    settings = parse(parse_uri("redis+cluster://u:pw@a,b:7001,[::1]:7002/"))
    assert settings.cluster == (("a", 6379), ("b", 7001), ("::1", 7002))
    assert dict(settings.kwargs) == {"username": "u", "password": "pw"}
    assert "pw" not in settings.where.replace("//", "")
    assert parse(parse_uri("redis+cluster://a/0")).cluster == (("a", 6379),)
    (tmp_path / "ca.pem").write_text("")
    tls = parse(parse_uri(f"rediss+cluster://a,b?ssl_ca_certs={tmp_path}/ca.pem")).kwargs
    assert (tls["ssl"], tls["ssl_ca_certs"]) == (True, f"{tmp_path}/ca.pem")
    assert not parse(parse_uri("redis+cluster://a")).kwargs.get("ssl")


def test_a_sentinel_uri_without_tls_options_does_not_ask_for_tls(tmp_path: Path) -> None:
    """Plain redis+sentinel:// talks plain Redis to the master; TLS only when asked for."""
    assert not parse(parse_uri("redis+sentinel://s/svc")).kwargs.get("ssl")
    (tmp_path / "ca.pem").write_text("")
    tls = parse(parse_uri(f"redis+sentinel://s/svc?ssl_ca_certs={tmp_path}/ca.pem")).kwargs
    assert (tls["ssl"], tls["ssl_ca_certs"]) == (True, f"{tmp_path}/ca.pem")


# More bad URIs (unknown options, ports, paths) exit 78 through the CLI: test_config.py.
@pytest.mark.parametrize(
    "text",
    [
        "redis://h?password=hunter2",
        "unix:///s.sock?ssl_certfile=/c.pem",
        "redis+sentinel://s/svc?username=u",
        "redis://h:65536",
        "redis+sentinel://s/svc/x",
        "redis+cluster://a,b/1",
        "redis+cluster://a?password=hunter2",
    ],
)
def test_parse_rejects_bad_uris(text: str) -> None:
    """Unknown options, bad ports, dbs, paths and services raise ConfigError (exit 78)."""
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(text))
    assert "hunter2" not in str(raised.value)


AWKWARD_PAIRS = [
    ("a/b", "c"),
    ("a", "b/c"),
    ("a%2Fb", "c"),
    ("a%2fb", "c"),
    ("a", "b}c"),
    ("a}", "{b"),
    ("a", "b%7Dc"),
    ("a", "b c"),
    ("a", "b%20c"),
    ("a", "b\tc"),
    ("a", "b\nc"),
    ("a", "b*"),
    ("a", "b?"),
    ("a", "[b]"),
    ("a", "b\\"),
    ("a", "b:c"),
    ("ä", "ö"),
    ("default", "x"),
]


def test_key_prefix_keeps_the_hash_tag_and_the_separator_intact() -> None:
    """Keys escape what would end the hash tag, split NS from NAME or glob; no two collide.

    Distinct (namespace, name) pairs get distinct prefixes, and `status` can read the
    namespace and the name back from a key by percent-decoding.
    """
    assert key_prefix("default", "x") == "lockrun:{default/x}"
    assert key_prefix("ä", "ö") == "lockrun:{ä/ö}"  # UTF-8 stays readable in redis-cli
    prefixes = set()
    for namespace, name in AWKWARD_PAIRS:
        prefix = key_prefix(namespace, name)
        assert prefix.startswith("lockrun:{")
        assert prefix.endswith("}")
        inside = prefix.removeprefix("lockrun:{").removesuffix("}")
        assert inside.count("/") == 1, prefix
        assert not set(inside) & set("{}*?[]\\ \t\n"), prefix
        escaped_namespace, _, escaped_name = inside.partition("/")
        assert (unquote(escaped_namespace), unquote(escaped_name)) == (namespace, name)
        prefixes.add(prefix)
    assert len(prefixes) == len(AWKWARD_PAIRS)


# -- E. the Python API: a lease lost while the block ran -------------------------------------------


def test_api_reports_a_lease_it_could_not_confirm(redis_server: RedisServer, name: str) -> None:
    """The server gone for longer than the ttl: leaving the block raises LeaseLost."""
    lock = Lock(name, uri=redis_server.uri, ttl=1)
    lock.acquire()
    redis_server.stop()
    time.sleep(2.5)  # renewals fail for more than a ttl
    with pytest.raises(LeaseLost, match="could not be confirmed"):
        lock.release()


# -- F. a kept backend: what an acquisition costs, and what a reconnect redoes --------------------


def _calls(server: RedisServer) -> dict[str, int]:
    """Return how often each command ran on *server* since its last CONFIG RESETSTAT."""
    calls = {}
    for line in server.command("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            command, _, stats = line.removeprefix("cmdstat_").partition(":")
            fields = dict(field.split("=", 1) for field in stats.split(","))
            calls[command] = int(fields["calls"])
    for ours in ("config|resetstat", "info"):  # the test's own
        calls.pop(ours, None)
    return calls


def test_an_uncontended_lock_costs_one_small_script_each_way(
    redis_server: RedisServer, name: str
) -> None:
    """A kept backend, a free lock: EVALSHA to take it and to leave it, a few calls inside each.

    Nothing else per acquisition: the eviction check, the CLIENT ID and the scripts are the
    backend's (or its connection's) to learn once.
    """
    backend = open_backend(parse_uri(redis_server.uri), ttl=30)
    request = Request("default", name, 1, 30.0, Holder.me(["x"]))
    cycles = 10
    try:
        for deadline in (0, None):  # one try, then a wait (which names its connection)
            backend.acquire(request, deadline).release()  # type: ignore[union-attr]
        redis_server.command("CONFIG", "RESETSTAT")
        for _ in range(cycles):
            for deadline in (0, None):
                lease = backend.acquire(request, deadline)
                assert lease is not None
                lease.release()
        calls = _calls(redis_server)
    finally:
        backend.close()
    scripts = calls.pop("evalsha")
    assert scripts == 2 * 2 * cycles, calls
    assert not [command for command in calls if command.startswith(("client", "config", "script"))]
    assert sum(calls.values()) <= 12 * scripts, calls  # the general path makes about 28


def test_a_kept_backend_carries_on_after_a_restart_and_a_script_flush(
    redis_server: RedisServer, name: str
) -> None:
    """Connections or scripts gone between acquisitions: the next works, with a larger fence."""

    def restart() -> None:
        redis_server.stop()
        redis_server.start()

    backend = open_backend(parse_uri(redis_server.uri), ttl=30)
    request = Request("default", name, 1, 30.0, Holder.me(["x"]))
    fences: list[int] = []
    try:
        for upset in (lambda: None, restart, lambda: redis_server.command("SCRIPT", "FLUSH")):
            upset()
            # a wait (which names its connection), then a try
            fences.extend(_fence_of_a_cycle(backend, request, wait) for wait in (None, 0))
    finally:
        backend.close()
    assert fences == sorted(set(fences)), fences


def test_a_waiter_whose_connection_was_cut_names_its_new_one(
    redis_server: RedisServer, name: str
) -> None:
    """Its connection killed between acquisitions: the next wait names a live connection.

    A releaser takes a slot back from a waiter whose named connection is gone: a stale
    CLIENT ID would have the living waiter passed over.
    """
    uri = parse_uri(redis_server.uri)
    waiter, holder = open_backend(uri, ttl=30), open_backend(uri, ttl=30)
    request = Request("default", name, 1, 30.0, Holder.me(["x"]))
    clients = f"{key_prefix('default', name)}:clients"
    got: list[Lease | None] = []
    try:
        lease = waiter.acquire(request, None)  # learns the CLIENT ID of its connection
        assert lease is not None
        lease.release()
        redis_server.command("CLIENT", "KILL", "TYPE", "normal")  # all but redis-cli itself
        held = holder.acquire(request, 0)
        assert held is not None
        thread = threading.Thread(target=lambda: got.append(waiter.acquire(request, now() + 20)))
        thread.start()
        try:
            wait_for(lambda: redis_server.command("HVALS", clients), what="the waiter's CLIENT ID")
            named = redis_server.command("HVALS", clients)
            assert redis_server.command("CLIENT", "LIST", "ID", named).startswith(f"id={named} ")
        finally:
            held.release()
            thread.join(PATIENCE)
    finally:
        waiter.close()
        holder.close()
    assert got
    assert got[0] is not None
    got[0].release()


def test_a_retried_acquire_gets_the_same_slot_and_fence(
    redis_server: RedisServer, name: str
) -> None:
    """The acquire script run twice for one token (its reply lost, docs/design.md D3): one grant."""
    backend = connect(parse_uri(redis_server.uri), ttl=30)
    claim = Claim(key_prefix("default", name), "retried", 1, 30_000)
    try:
        first = backend.call(ACQUIRE, claim, "{}", "try", identify=False)
        again = backend.call(ACQUIRE, claim, "{}", "try", identify=False)
        other_claim = Claim(claim.prefix, "other", 1, 30_000)
        other = backend.call(ACQUIRE, other_claim, "{}", "try", identify=False)
    finally:
        backend.close()
    assert isinstance(first, Granted)
    assert again == first
    assert isinstance(other, Queued)  # busy: no second slot


def test_a_kept_backends_scripts_take_no_connection_from_the_pool(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acquire and release run on one kept connection: the pool's checks cost more than them.

    And none is made again: the server counts no new connection.
    """
    backend = open_backend(parse_uri(redis_server.uri), ttl=30)
    request = Request("default", name, 1, 30.0, Holder.me(["x"]))
    taken: list[object] = []
    try:
        backend.acquire(request, 0).release()  # type: ignore[union-attr]  # connects
        pool = backend.server.client().connection_pool  # type: ignore[attr-defined]
        take = pool.get_connection

        def noted() -> object:
            taken.append(take())
            return taken[-1]

        monkeypatch.setattr(pool, "get_connection", noted)
        before = _received(redis_server)
        for _ in range(10):
            backend.acquire(request, 0).release()  # type: ignore[union-attr]
        after = _received(redis_server)
    finally:
        backend.close()
    assert taken == []
    assert after == before + 1  # redis-cli's own, to ask


def _received(server: RedisServer) -> int:
    """Return how many connections *server* has accepted (redis-cli's asking included)."""
    stats = server.command("INFO", "stats")
    return int(stats.split("total_connections_received:", 1)[1].split()[0])


def test_a_lease_with_a_bell_is_released_before_its_listener_is_joined(
    redis_server: RedisServer, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release goes out first: joining the bell's thread is off the hand-over's path."""
    backend = open_backend(parse_uri(redis_server.uri), ttl=30)
    order: list[str] = []
    try:
        lease = backend.acquire(Request("default", name, 1, 30.0, Holder.me(["x"])), 0)
        assert lease is not None
        assert lease.bells  # a lone holder's: a thread listens
        listener = lease._listener  # type: ignore[attr-defined]
        join, leave = listener.join, backend.leave  # type: ignore[attr-defined]

        def joined(timeout: float | None = None) -> None:
            order.append("join")
            join(timeout)

        def left(*args: object, **kwargs: object) -> bool:
            order.append("release")
            return bool(leave(*args, **kwargs))

        monkeypatch.setattr(listener, "join", joined)
        monkeypatch.setattr(backend, "leave", left)
        assert lease.release()
    finally:
        backend.close()
    assert order == ["release", "join"]
