"""etcd clusters of three members: a leader killed, a member restarted, never two holders.

Every lockrun gets the URI of all three members and asks the first that answers; these
tests take members away under a holder and a queued waiter and judge lockrun by the
oracle's times (tests/support/oracle.py), never by its word: no overlap, the fences rising,
the holder's lease kept through an election (etcd's leases survive one), the waiter
running once the holder is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.support.cli import wait_for
from tests.support.servers import EtcdCluster

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterator

    from tests.support.oracle import Oracle
    from tests.support.servers import EtcdServer

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
    oracle.release(then)
    assert waiter.wait(60) == 0, waiter.stderr.read() if waiter.stderr else ""
    assert oracle.overlaps() == []
    assert then.fence > held.fence > 0


def test_a_holder_and_a_waiter_live_through_the_leaders_death(
    cluster: EtcdCluster, oracle: Oracle, spawn: Callable[..., subprocess.Popen[str]], name: str
) -> None:
    def kill_the_leader() -> None:
        leader = cluster.wait_leader()
        cluster.kill(leader)
        cluster.wait_leader(other_than=leader)

    run_through(cluster, oracle, spawn, name, kill_the_leader)


def test_a_holder_and_a_waiter_live_through_a_restart_of_the_member_they_ask(
    cluster: EtcdCluster, oracle: Oracle, spawn: Callable[..., subprocess.Popen[str]], name: str
) -> None:
    """The member both ask first goes away and comes back: they ask the others meanwhile."""
    run_through(cluster, oracle, spawn, name, lambda: cluster.restart(first_asked(cluster)))


def test_the_member_asked_first_dead_from_the_start(
    cluster: EtcdCluster, oracle: Oracle, spawn: Callable[..., subprocess.Popen[str]], name: str
) -> None:
    """A URI whose first member is down: every call goes to the next, and nothing waits on it."""
    cluster.kill(first_asked(cluster))
    cluster.wait_leader(other_than=first_asked(cluster))
    run_through(cluster, oracle, spawn, name, lambda: None)
