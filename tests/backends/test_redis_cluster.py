"""Redis Cluster: redis+cluster:// on a real three-primary cluster, and plain URIs to its nodes.

A focused subset of the contract suite (taking turns, fences, busy, order, a semaphore,
status, a take-over) runs on locks that live on each primary; the rest of the contract
holds for the same scripts on one server. Then what only a cluster has: every key of a
lock in one slot, a plain redis:// URI that names a node, and grants that count only once
a replica has them. Resharding and failover under load: tests/chaos/test_cluster.py.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.redis import key_prefix
from lockrun.backends.redis.scripts import SCRIPTS, keys_of
from lockrun.errors import ExitCode
from lockrun.timing import now
from tests.support.cli import (
    Held,
    finish,
    holder_pids,
    lockrun,
    one_line,
    states,
    wait_for,
    waiter_pids,
)
from tests.support.clusters import Cluster, slot_of
from tests.support.harness import paused
from tests.support.net import make_certificates
from tests.support.servers import RedisServer, free_port

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from pathlib import Path


def name_on(cluster: Cluster, port: int, stem: str, namespace: str = "default") -> str:
    """Return a lock name, starting with *stem*, whose keys the primary on *port* serves."""
    (primary,) = (node for node in cluster.nodes() if node.port == port)
    for number in range(100_000):
        name = f"{stem}-{number}"
        if primary.serves(slot_of(key_prefix(namespace, name))):
            return name
    raise AssertionError(port)


def primaries(cluster: Cluster) -> list[int]:
    """Return the ports of the cluster's primaries."""
    return sorted(node.port for node in cluster.nodes() if node.is_primary)


# -- one slot per lock ---------------------------------------------------------------------------


@settings(max_examples=50)
@given(namespace=st.text(max_size=20), name=st.text(min_size=1, max_size=40))
def test_every_key_of_a_lock_is_in_the_slot_of_its_hash_tag(namespace: str, name: str) -> None:
    """Whatever the name (braces and all), every key of it, wake lists included, is in one slot."""
    prefix = key_prefix(namespace, name)
    keys = [*keys_of(prefix), f"{prefix}:wake:0123abcd", f"{prefix}:wake:s:ff"]
    assert {slot_of(key) for key in keys} == {slot_of(prefix)}


def test_the_scripts_touch_only_their_declared_keys_and_the_wake_lists() -> None:
    """Each redis.call names a key of KEYS, a loop over them, or PREFIX:wake:TOKEN (same tag)."""
    declared = {"holders", "queue", "waiters", "ticket", "fence", "owners", "info", "cfg"}
    declared |= {"clients", "stop"}
    keyless = {"TIME"}
    for script, text in ((name, each.text) for name, each in SCRIPTS.items()):
        for command, first in re.findall(r"redis\.p?call\('(\w+)'(?:, ([^,)]+))?", text):
            if command in keyless:
                continue
            wake = first.startswith("prefix .. ':wake:' ..")
            looped = first == "key" and "ipairs({" in text  # a loop over declared keys, or a wake
            assert first in declared or wake or looped, (script, command, first)
    for loop in re.findall(
        r"ipairs\(\{([^}]*)\}\)", "".join(each.text for each in SCRIPTS.values())
    ):
        assert set(re.split(r",\s*", loop)) <= declared, loop


# -- the contract, on each primary ---------------------------------------------------------------


def test_runs_take_turns_with_rising_fences_on_every_primary(
    redis_cluster: Cluster, name: str, held: Callable[..., Held]
) -> None:
    """On each primary's slots: fences rise, a held lock is busy (75), status names the holder."""
    uri = redis_cluster.uri
    for port in primaries(redis_cluster):
        lock = name_on(redis_cluster, port, name)
        fences = []
        for _ in range(2):
            result = lockrun("--uri", uri, "-n", lock, "--", "sh", "-c", 'echo "$LOCKRUN_FENCE"')
            assert (result.returncode, result.stderr) == (0, ""), result.stderr
            fences.append(int(result.stdout))
        holder = held("--uri", uri, "-n", lock)
        assert fences[0] < fences[1] < holder.fence
        busy = lockrun("--uri", uri, "-n", lock, "-w", "0", "--", "true")
        assert busy.returncode == ExitCode.BUSY
        assert f"{lock} busy" in one_line(busy.stderr)
        assert holder_pids(uri, lock) == [holder.process.pid]
        assert holder.finish() == 0
        assert holder_pids(uri, lock) == []


def test_a_lease_with_no_process_is_renewed_and_released_through_any_seed_order(
    redis_cluster: Cluster, name: str
) -> None:
    """A --no-keeper lease on a cluster: busy while kept, renewed and released by its token."""
    uri = redis_cluster.uri
    scheme, _, rest = uri.partition("//")
    reordered = f"{scheme}//{','.join(reversed(rest.split(',')))}"  # another job's spelling
    acquired = lockrun("acquire", "--uri", uri, "--no-keeper", "--ttl", "30", name)
    assert acquired.returncode == 0, acquired.stderr
    token = acquired.stdout.strip()
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == ExitCode.BUSY
    assert lockrun("renew", "--uri", reordered, token).returncode == 0
    assert lockrun("release", "--uri", reordered, token).returncode == 0
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0
    assert lockrun("release", "--uri", uri, token).returncode == ExitCode.LOST


def test_waiters_go_in_arrival_order_and_a_semaphore_counts_its_slots(
    redis_cluster: Cluster,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    """Two queued waiters run in the order they came; -s 2 lets two in, and the third is busy."""
    uri = redis_cluster.uri
    holder = held("--uri", uri, "-n", name)
    order = tmp_path / "order"
    waiters = []
    for tag in ("first", "second"):
        waiters.append(
            spawn("--uri", uri, "-n", name, "-w", "60", "--", "sh", "-c", f"echo {tag} >> {order}")
        )
        queued = [waiter.pid for waiter in waiters]
        wait_for(lambda queued=queued: waiter_pids(uri, name) == queued, what="the queue")  # type: ignore[misc]
    assert holder.finish() == 0
    assert [finish(waiter) for waiter in waiters] == [0, 0]
    assert order.read_text().split() == ["first", "second"]

    semaphore = f"{name}-s"
    one, two = (
        held("--uri", uri, "-n", semaphore, "-s", "2"),
        held("--uri", uri, "-n", semaphore, "-s", "2"),
    )
    assert {one.slot, two.slot} == {0, 1}
    busy = lockrun("--uri", uri, "-n", semaphore, "-s", "2", "--", "true")
    assert busy.returncode == ExitCode.BUSY, busy.stderr
    assert (one.finish(), two.finish()) == (0, 0)


def test_status_lists_the_locks_of_every_primary(
    redis_cluster: Cluster, name: str, held: Callable[..., Held]
) -> None:
    """`lockrun status` without NAME scans each primary: locks on all three are listed."""
    uri, namespace = redis_cluster.uri, name
    locks = [name_on(redis_cluster, port, "job", namespace) for port in primaries(redis_cluster)]
    holders = [held("--uri", uri, "--namespace", namespace, "-n", lock) for lock in locks]
    shown = lockrun("status", "--uri", uri, "--namespace", namespace, "--json")
    assert (shown.returncode, shown.stderr) == (0, "")
    assert sorted(state["name"] for state in json.loads(shown.stdout)) == sorted(locks)
    assert [holder.finish() for holder in holders] == [0, 0, 0]


def test_a_take_over_stops_the_holder_at_its_next_renewal(
    redis_cluster: Cluster, name: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """No bell on a cluster: the holder hears the taker at a renewal (ttl/3), exits 79."""
    uri = redis_cluster.uri
    holder = spawn("--uri", uri, "-n", name, "--ttl", "3", "--kill-after", "1", "--", "sleep", "60")
    wait_for(lambda: holder_pids(uri, name) == [holder.pid], what="the holder")
    taker = lockrun("--uri", uri, "-n", name, "--ttl", "3", "--take-over", "-w", "20", "--", "true")
    assert (taker.returncode, taker.stderr) == (0, "")
    assert finish(holder) == ExitCode.TAKEN_OVER


# -- what only a cluster has ---------------------------------------------------------------------


def test_a_plain_uri_naming_a_node_follows_the_cluster(
    redis_cluster: Cluster, name: str, held: Callable[..., Held]
) -> None:
    """redis:// to any node works as redis+cluster:// (a -v line says so): one lock, both ways."""
    slot = slot_of(key_prefix("default", name))
    serving = redis_cluster.owner(slot)
    other = redis_cluster.other_primary(serving)
    holder = held("--uri", redis_cluster.uri, "-n", name)
    for port in (serving, other):
        plain = f"redis://127.0.0.1:{port}"
        busy = lockrun("-v", "--uri", plain, "-n", name, "--", "true")
        assert busy.returncode == ExitCode.BUSY, busy.stderr
        assert (
            f"lockrun: {plain} is a node of a Redis Cluster: using it as "
            f"redis+cluster://127.0.0.1:{port}"
        ) in busy.stderr.splitlines()
    assert holder.finish() == 0
    ran = lockrun("--uri", f"redis://127.0.0.1:{other}/0", "-n", name, "--", "true")
    assert (ran.returncode, ran.stderr) == (0, "")


@pytest.mark.parametrize("reach", ["unix", "database"])
def test_a_plain_uri_that_cannot_reach_the_cluster_is_78(
    redis_cluster: Cluster, name: str, reach: str
) -> None:
    """A node through its unix socket, or database 2: 78, one line naming redis+cluster://."""
    port = primaries(redis_cluster)[0]
    server = redis_cluster.servers[port]
    uri = server.uri if reach == "unix" else f"redis://127.0.0.1:{port}/2"
    result = lockrun("--uri", uri, "-n", name, "--", "true")
    assert result.returncode == ExitCode.CONFIG, result.stderr
    line = one_line(result.stderr)
    # Valkey 9 has databases in cluster mode, and says that one does not exist
    assert "redis+cluster://" in line or "no such database" in line
    assert states(redis_cluster.uri, name)[0]["holders"] == []


def test_no_grant_counts_until_a_replica_has_it(
    redis_cluster: Cluster, name: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """With the primary's replica stopped, -w 0 is 69 and holds nothing; a waiter waits it out."""
    uri = redis_cluster.uri
    primary = redis_cluster.owner(slot_of(key_prefix("default", name)))
    replica = redis_cluster.servers[redis_cluster.replica_of(primary)]
    try:
        with paused(replica.pid):
            refused = lockrun("--uri", uri, "-n", name, "--", "true")
            assert refused.returncode == ExitCode.UNAVAILABLE, refused.stderr
            assert "acknowledged the lease" in one_line(refused.stderr)
            assert states(uri, name)[0]["holders"] == []
            waiter = spawn("--uri", uri, "-n", name, "-w", "60", "--", "true")
            # Granted on the primary, unconfirmed: it waits on, and so does a newcomer.
            wait_for(lambda: holder_pids(uri, name) == [waiter.pid], what="the grant")
            busy = lockrun("--uri", uri, "-n", name, "--", "true")
            assert busy.returncode == ExitCode.BUSY, busy.stderr
            assert waiter.poll() is None
        assert finish(waiter) == 0
        assert states(uri, name)[0]["holders"] == []
    finally:
        redis_cluster.wait_settled()


def tryagains(cluster: Cluster, port: int) -> int:
    """Return how many TRYAGAIN errors the node on *port* has answered (INFO errorstats)."""
    found = re.search(
        r"errorstat_TRYAGAIN:count=(\d+)", cluster.command(port, "INFO", "errorstats")
    )
    return int(found[1]) if found else 0


def test_a_lock_whose_slot_is_migrating_waits_for_the_migration(
    redis_cluster: Cluster, name: str, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    """Mid-migration (ASK, then TRYAGAIN): -w 0 is 69 in one line; a waiter runs once it ends."""
    uri, slot = redis_cluster.uri, slot_of(key_prefix("default", name))
    source = redis_cluster.owner(slot)
    target = redis_cluster.other_primary(source)
    ids = {node.port: node.id for node in redis_cluster.nodes()}
    redis_cluster.command(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source])
    redis_cluster.command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target])
    try:
        refused = lockrun("--uri", uri, "-n", name, "--", "true")
        assert refused.returncode == ExitCode.UNAVAILABLE, refused.stderr
        assert "no node of the cluster could serve this lock" in one_line(refused.stderr)
        before = tryagains(redis_cluster, target)
        waiter = spawn("--uri", uri, "-n", name, "-w", "60", "--", "true")
        wait_for(lambda: tryagains(redis_cluster, target) > before + 1, what="the waiter to ask")
        assert waiter.poll() is None
    finally:
        redis_cluster.reshard(slot, target)  # no keys to move: SETSLOT NODE everywhere
    assert finish(waiter) == 0


@pytest.mark.slow  # a cluster of its own: CI's normal phase has no seconds to spare
def test_rediss_cluster_checks_every_node_it_is_redirected_to(tmp_path: Path, name: str) -> None:
    """rediss+cluster:// runs on each primary; another CA, or plain redis+cluster://, is 69."""
    make_certificates(tmp_path)
    try:
        cluster = Cluster(tls=tmp_path)
    except pytest.fail.Exception as err:  # as test_redis.py's test_tls
        if "tls" not in str(err).lower():
            raise
        pytest.skip(f"this redis-server has no TLS support: {err}")
    try:
        for port in primaries(cluster):
            lock = name_on(cluster, port, name)
            ran = lockrun("--uri", cluster.uri, "-n", lock, "--", "true")
            assert (ran.returncode, ran.stderr) == (0, "")
        other_ca = cluster.uri.replace("ca.crt", "other-ca.crt")
        plain = cluster.uri.replace("rediss+", "redis+").partition("?")[0]
        for uri in (other_ca, plain):
            result = lockrun("--uri", uri, "-n", name, "--", "true")
            assert result.returncode == ExitCode.UNAVAILABLE, result.stderr
            one_line(result.stderr)
    finally:
        cluster.close()


@pytest.mark.slow  # kills and restarts a node, and waits for the cluster to mark it failed
def test_a_primary_whose_replica_died_is_trusted_alone_once_the_cluster_marks_it_failed(
    redis_cluster: Cluster, name: str
) -> None:
    """Its replica killed: 69 while the cluster may still promote it, runs once marked fail."""
    uri = redis_cluster.uri
    primary = redis_cluster.owner(slot_of(key_prefix("default", name)))
    port = redis_cluster.replica_of(primary)
    replica = redis_cluster.servers[port]

    def marked_failed() -> bool:
        return any(
            node.port == port and "fail" in node.flags for node in redis_cluster.nodes(primary)
        )

    replica.stop()
    try:
        refused = lockrun("--uri", uri, "-n", name, "--", "true")
        if refused.returncode == 0:
            # The cluster marks it failed after NODE_TIMEOUT (1 s); a start-up at load 30 can
            # take longer. The mark never goes away while it is down, so it must show now.
            assert marked_failed(), "ran alone before the cluster marked the replica failed"
        else:
            assert refused.returncode == ExitCode.UNAVAILABLE, refused.stderr
            assert "has no replica in sync, but the cluster lists 1" in one_line(refused.stderr)
        wait_for(marked_failed, 30, "the cluster to mark the replica failed")
        ran = lockrun("--uri", uri, "-n", name, "--", "true")
        assert (ran.returncode, ran.stderr) == (0, "")
    finally:
        replica.start()  # nodes.conf keeps its identity: it rejoins as the replica
        redis_cluster.wait_settled()


def test_a_cluster_uri_naming_a_lone_server_is_78_and_holds_nothing(name: str) -> None:
    """redis+cluster:// to a server without cluster support: 78 naming redis://, no lock left."""
    server = RedisServer(port=free_port())
    try:
        uri = f"redis+cluster://127.0.0.1:{server.port}"
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert result.returncode == ExitCode.CONFIG, result.stderr
        assert "use redis://" in one_line(result.stderr)
        assert states(server.tcp_uri, name)[0]["holders"] == []
    finally:
        server.close()


def test_a_moved_answer_switches_a_plain_uri_where_hello_hid_the_cluster(
    redis_cluster: Cluster, name: str
) -> None:
    """A proxy may hide HELLO's mode: the first MOVED switches to the cluster's ways, once."""
    slot = slot_of(key_prefix("default", name))
    other = redis_cluster.other_primary(redis_cluster.owner(slot))
    notes: list[str] = []
    backend = open_backend(parse_uri(f"redis://127.0.0.1:{other}"), ttl=5.0, note=notes.append)
    backend.server.mode_known = True  # type: ignore[attr-defined]  # as if HELLO had said nothing
    try:
        lease = backend.acquire(Request("default", name, 1, 5.0, Holder.me(["x"])), now() + 5)
        assert lease is not None
        assert lease.fence is not None
        lease.release()
    finally:
        backend.close()
    assert notes == [
        (
            f"redis://127.0.0.1:{other} is a node of a Redis Cluster: using it as "
            f"redis+cluster://127.0.0.1:{other}"
        )
    ]
