"""etcd clusters of three members: a leader killed, a member restarted, never two holders.

Every lockrun gets the URI of all three members and asks the first that answers; these
tests take members away under a holder and a queued waiter and judge lockrun by the
oracle's times (tests/support/oracle.py), never by its word: no overlap, the fences rising,
the holder's lease kept through an election (etcd's leases survive one), the waiter
running once the holder is done.
"""

from __future__ import annotations

import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from tests.support.cli import wait_for
from tests.support.sentinels import Namespace, UnixOracle
from tests.support.servers import ETCDCTL, EtcdCluster, EtcdServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.support.oracle import Oracle

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(180)]

# Long enough that an election (about a second here, up to a few on a loaded machine) and
# a call that times out on the dead member fit well within one lease: the holder keeps it.
LEASE = ("--ttl", "10", "--kill-after", "1")


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    """Return three members of a fresh cluster, closed at teardown."""
    made = EtcdCluster()
    made.wait_leader()
    yield made
    made.close()


def first_asked(cluster: EtcdCluster) -> EtcdServer:
    """Return the member lockrun asks first: the first in the URI."""
    return cluster.members[0]


def run_through(
    cluster: EtcdCluster,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
    name: str,
    fault: Callable[[], None],
    record: Callable[..., None],
) -> None:
    """Hold *name*, queue a waiter, inflict *fault*, release: one holder at a time, in order."""
    options = ("--uri", cluster.uri, "-n", name, *LEASE)
    holder, held = oracle.hold(spawn, "holder", *options)
    waiter = spawn(*options, "-w", "120", "--", *oracle.command("waiter"))
    wait_for(
        lambda: (
            len(
                cluster.etcdctl(
                    "get", "--prefix", f"lockrun/default/{name}/q/", "--keys-only"
                ).stdout.split()
            )
            == 2
        ),
        what="the waiter's key",
    )
    fault()
    oracle.release(held)
    assert holder.wait(60) == 0, holder.stderr.read() if holder.stderr else ""
    then = oracle.wait_started("waiter", timeout=90)
    assert held.end is not None
    record("the holder's end to the waiter's start", seconds=then.start - held.end)
    oracle.release(then)
    assert waiter.wait(60) == 0, waiter.stderr.read() if waiter.stderr else ""
    assert oracle.overlaps() == []
    assert then.fence > held.fence > 0


def test_a_holder_and_a_waiter_live_through_the_leaders_death(
    cluster: EtcdCluster,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
    name: str,
    record: Callable[..., None],
) -> None:
    def kill_the_leader() -> None:
        leader = cluster.wait_leader()
        cluster.kill(leader)
        cluster.wait_leader(other_than=leader)

    run_through(cluster, oracle, spawn, name, kill_the_leader, record)


def test_a_holder_and_a_waiter_live_through_a_restart_of_the_member_they_ask(
    cluster: EtcdCluster,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
    name: str,
    record: Callable[..., None],
) -> None:
    """The member both ask first goes away and comes back: they ask the others meanwhile."""
    restart = lambda: cluster.restart(first_asked(cluster))  # noqa: E731
    run_through(cluster, oracle, spawn, name, restart, record)


def test_the_member_asked_first_dead_from_the_start(
    cluster: EtcdCluster,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
    name: str,
    record: Callable[..., None],
) -> None:
    """A URI whose first member is down: every call goes to the next, and nothing waits on it."""
    cluster.kill(first_asked(cluster))
    cluster.wait_leader(other_than=first_asked(cluster))
    run_through(cluster, oracle, spawn, name, lambda: None, record)


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    """Return a network namespace joined to ours by a veth pair, deleted at teardown."""
    made = Namespace()
    yield made
    made.close()


def test_a_holder_cut_off_with_its_member_is_stopped_before_the_others_grant_again(
    namespace: Namespace,
    tmp_path: Path,
    spawn: Callable[..., subprocess.Popen[str]],
    name: str,
    record: Callable[..., None],
) -> None:
    """The holder and the member it asks first, cut off from the two others (namespaces).

    That member has no leader: the holder's keep-alives fail there and cannot reach the
    others, so it is stopped by its lease's deadline (76). The two others let the lease
    run out and grant the waiter, once the holder's command is dead. The member cut off is
    a follower: a leader cut off serves keep-alives until it steps down, an election
    timeout later, which etcd's next leader allows for by extending every lease by as much
    (etcd PR #4778); that case is the leader's death above.
    """
    peers = [free_port() for _ in range(3)]
    hosts = [namespace.inner, namespace.outer, namespace.outer]
    cluster = ",".join(f"lr{i}=http://{hosts[i]}:{peers[i]}" for i in range(3))
    members = [
        EtcdServer(
            peer_port=peers[i],
            name=f"lr{i}",
            cluster=cluster,
            host=hosts[i],
            prefix=namespace.prefix if i == 0 else (),
        )
        for i in range(3)
    ]
    oracle = UnixOracle(str(tmp_path))
    try:
        for member in members:
            member.ready(patience=60)
        leader = wait_for_leader(members)
        if leader is members[0]:  # hand leadership to a member that stays with the majority
            subprocess.run(
                [ETCDCTL, "--endpoints", members[0].uri, "move-leader", member_id(members[1])],
                check=True,
                capture_output=True,
                timeout=30,
            )
        everyone = ",".join(f"{member.host}:{member.port}" for member in members)
        lease = ("--ttl", "6", "--kill-after", "1")
        holder, held = oracle.hold(
            spawn,
            "holder",
            "--uri", f"etcd://{everyone}", "-n", name, *lease,
            under=namespace.prefix,  # lockrun, its guardian and its command in the namespace
        )  # fmt: skip
        assert holder.poll() is None
        others = ",".join(f"{member.host}:{member.port}" for member in members[1:])
        waiter = spawn(
            "--uri", f"etcd://{others}", "-n", name, *lease, "-w", "60",
            "--", *oracle.command("waiter"),
        )  # fmt: skip
        cut = time.monotonic()
        namespace.cut()
        holder.wait(60)
        assert holder.returncode == 76, holder.stderr.read() if holder.stderr else ""
        then = oracle.wait_started("waiter", timeout=60)
        oracle.release(then)
        assert waiter.wait(60) == 0, waiter.stderr.read() if waiter.stderr else ""
        assert oracle.overlaps() == []
        assert held.end is not None
        record(
            "cut off with its member",
            stopped_after=held.end - cut,
            next_after_the_end=then.start - held.end,
        )
        assert then.fence > held.fence > 0
    finally:
        namespace.heal()
        oracle.close()
        for member in members:
            member.close()


def wait_for_leader(members: list[EtcdServer]) -> EtcdServer:
    """Return the member that leads, once one does."""
    found: list[EtcdServer] = []

    def led() -> bool:
        for member in members:
            status = member.call("/v3/maintenance/status", timeout=2)
            if status.get("leader") == status["header"]["member_id"]:
                found.append(member)
                return True
        return False

    wait_for(led, timeout=30, what="a leader")
    return found[-1]


def member_id(member: EtcdServer) -> str:
    """Return *member*'s id in hex, as etcdctl's move-leader takes it."""
    return f"{int(member.call('/v3/maintenance/status')['header']['member_id']):x}"
