"""Redis Cluster under load: the lock's slot resharded, its primary failed over, then killed.

Holders loop on one name through redis+cluster:// while the test moves the lock's hash
slot to another primary (SETSLOT MIGRATING/IMPORTING and MIGRATE, as redis-cli --cluster
reshard does), fails that primary over to its replica (CLUSTER FAILOVER), and then
SIGKILLs the primary that serves the slot, whose replica the cluster promotes. The oracle
(tests/support/oracle.py: the kernel closes each command's socket however it ends) must
never see two commands at once, and each command's fence must be larger than those of
all that ran before it.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Final

import pytest

from lockrun.backends.redis import key_prefix
from tests.support.cli import start, unmeasured
from tests.support.clusters import Cluster, slot_of
from tests.support.harness import LEASE, SLACK, TTL

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.support.oracle import Oracle, Run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LOOPS: Final = 3  # lockrun processes asking for the lock at any time
HOLD: Final = 0.2  # s: each command's run
SETTLED: Final = 3  # runs that must end after a change before the next one


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """Return a cluster of this test's own (it is resharded, failed over and killed)."""
    started = Cluster()
    yield started
    started.close()


class Loops:
    """*LOOPS* threads, each running lockrun around the oracle's command until `stop`."""

    def __init__(self, oracle: Oracle, uri: str, name: str, log: Path) -> None:
        """Start the threads; lockrun's stderr goes to *log*."""
        self.oracle, self.uri, self.name, self.log = oracle, uri, name, log
        self.statuses: list[int] = []
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(f"loop{i}",), daemon=True)
            for i in range(LOOPS)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, tag: str) -> None:
        options = ("--uri", self.uri, "-n", self.name, *LEASE, "-w", "forever")
        while not self._stopping.is_set():
            with self.log.open("a") as err:
                process = start(
                    *options,
                    "--",
                    *self.oracle.command(tag, hold=HOLD),
                    stderr=err,
                    env=unmeasured(),
                )
                self.statuses.append(process.wait(120))

    def ended_since(self, moment: float) -> int:
        """Return how many commands started after *moment* and have ended."""
        return sum(
            1 for run in self.oracle.runs if run.pid and run.start > moment and run.end is not None
        )

    def wait_runs(self, moment: float, what: str, timeout: float = 30) -> float:
        """Wait until *SETTLED* commands started after *moment* ended; return the first start."""
        self.oracle.wait(lambda: self.ended_since(moment) >= SETTLED, timeout, f"runs {what}")
        return min(run.start for run in self.oracle.runs if run.pid and run.start > moment)

    def stop(self) -> None:
        """Let the loops end after their current run."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(TTL * 4 + SLACK + 60)


def evidence(runs: list[Run], cluster: Cluster, log: Path) -> str:
    """Return the runs, lockrun's stderr and the nodes' logs, for a failure's message."""
    shown = "\n".join(
        f"{run.tag}: pid {run.pid} fence {run.fence} {run.start:.3f}-"
        f"{'…' if run.end is None else f'{run.end:.3f}'}"
        for run in runs
    )
    return f"{shown}\n--- lockrun\n{log.read_text()}\n{cluster.logs()[-4000:]}"


def server_ms(cluster: Cluster, port: int) -> int:
    """Return the clock of the node on *port*, in ms (what lease expiries are written in)."""
    seconds, micros = cluster.command(port, "TIME").split()
    return int(seconds) * 1000 + int(micros) // 1000


def renewed_after(cluster: Cluster, slot: int, key: str, moment_ms: int) -> bool:
    """Whether the node serving *slot* holds a lease in *key* renewed after *moment_ms*."""
    port = cluster.owner(slot)
    try:
        scores = cluster.command(port, "ZRANGE", key, "0", "-1", "WITHSCORES").split()
    except subprocess.CalledProcessError:  # MOVED while the nodes learn the news
        return False
    return len(scores) == 2 and float(scores[1]) > moment_ms + TTL * 1000


class Long:
    """A lockrun whose command holds until released: it must live through a change, or stop."""

    def __init__(self, oracle: Oracle, uri: str, name: str, log: Path, tag: str) -> None:
        """Queue behind the loops and wait until its command runs."""
        self.oracle = oracle
        with log.open("a") as err:
            options = ("--uri", uri, "-n", name, *LEASE, "-w", "forever")
            self.process = start(*options, "--", *oracle.command(tag), stderr=err)
        self.run = oracle.wait_started(tag, timeout=60)


def test_resharding_and_failovers_never_run_two_holders(
    cluster: Cluster,
    oracle: Oracle,
    name: str,
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """Reshard, CLUSTER FAILOVER, SIGKILL of the primary: no overlap, fences always rise.

    A holder lives through the resharding and the failover, renewing where the slot went;
    one holding when its primary is killed is stopped (76) before the replica the cluster
    promotes grants the lock again, once the lease it has from WAIT ran out there.
    """
    slot = slot_of(key_prefix("default", name))
    holders = f"{key_prefix('default', name)}:holders"
    log = tmp_path / "lockrun.err"
    loops = Loops(oracle, cluster.uri, name, log)
    try:
        loops.wait_runs(0.0, "at first")
        survivor = Long(oracle, cluster.uri, name, log, "survivor")
        source = cluster.owner(slot)
        target = cluster.other_primary(source)
        moment = server_ms(cluster, target)
        cluster.reshard(slot, target)
        oracle.wait(lambda: renewed_after(cluster, slot, holders, moment), TTL, "a renewal there")
        replica = cluster.replica_of(target)
        moment = server_ms(cluster, replica)
        cluster.failover(replica)
        oracle.wait(lambda: renewed_after(cluster, slot, holders, moment), TTL, "a renewal there")
        assert survivor.run.end is None, evidence(oracle.runs, cluster, log)
        oracle.release(survivor.run)
        assert survivor.process.wait(30) == 0, evidence(oracle.runs, cluster, log)
        loops.wait_runs(oracle.wait_ended(survivor.run), "after the failover")

        victim = Long(oracle, cluster.uri, name, log, "victim")
        doomed = cluster.owner(slot)
        cluster.kill(doomed)
        killed = time.monotonic()
        stopped = oracle.wait_ended(victim.run, timeout=TTL + SLACK)
        after_kill = loops.wait_runs(killed, "after the kill", timeout=60)
        assert victim.process.wait(30) == 76, evidence(oracle.runs, cluster, log)
        promoted = cluster.owner(slot)
    finally:
        loops.stop()
    runs = sorted((run for run in oracle.runs if run.pid), key=lambda run: run.start)
    details = evidence(runs, cluster, log)
    assert not oracle.overlaps(), details
    fences = [run.fence for run in runs]
    assert fences == sorted(fences), details
    assert len(set(fences)) == len(fences), details
    assert set(loops.statuses) <= {0, 76}, details
    assert "Traceback" not in log.read_text(), details
    assert promoted != doomed, details
    margins = [b.start - a.end for a, b in itertools.pairwise(runs) if a.end is not None]
    record(
        "cluster",
        runs=len(runs),
        lost=loops.statuses.count(76),
        min_margin=min(margins),
        stopped_after_kill=stopped - killed,
        next_run_after_kill=after_kill - killed,
        margin_after_kill=after_kill - stopped,
    )
