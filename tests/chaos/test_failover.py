"""Redis Sentinel failovers never run two holders at once (README "Sentinel").

Behind ``redis+sentinel://``, lockrun grants and renews only on the node a majority of the
URI's sentinels name, only while it says it is a primary, and only once a replica has the
write (WAIT). Before that, a demoted primary stayed writable for seconds after a failover,
and the holder went on renewing there while a contender got the lock on the new primary:
both ran for about 9 s. These tests fail a real primary over (tests/support/sentinels.py),
on request and by cutting it off with its holder, and judge lockrun by the oracle's times.
"""

from __future__ import annotations

import subprocess
import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.cli import holder_pids, wait_for, waiter_pids
from tests.support.harness import KILL_AFTER, LEASE, SLACK, TTL
from tests.support.sentinels import Namespace, SentinelSet, UnixOracle

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

    from tests.support.oracle import Oracle, Run


pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    """Return a primary, its replica and three sentinels on loopback, closed at teardown."""
    started = SentinelSet()
    yield started
    started.close()


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    """Return a network namespace joined to ours by a veth pair, deleted at teardown."""
    made = Namespace()
    yield made
    made.close()


@pytest.fixture
def split_sentinels(namespace: Namespace) -> Iterator[SentinelSet]:
    """Return a `SentinelSet` whose primary runs in `namespace`, closed at teardown."""
    started = SentinelSet(namespace)
    yield started
    started.close()


@pytest.fixture
def unix_oracle(tmp_path: Path) -> Iterator[UnixOracle]:
    """Return an oracle on a unix socket (reachable from a namespace), closed at teardown."""
    witness = UnixOracle(str(tmp_path))
    yield witness
    witness.close()


def until(condition: Callable[[], object], timeout: float) -> bool:
    """Poll *condition* for up to *timeout* seconds; return whether it came true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Contender:
    """A lockrun that waits for the lock forever, its stderr in a file.

    Right after a failover the new primary refuses grants for a while (no replica in sync
    until Sentinel re-points the old primary, ~10 s): a waiter waits on through that,
    within its --wait, rather than giving up with 69.
    """

    def __init__(
        self,
        spawn: Callable[..., subprocess.Popen[str]],
        oracle: Oracle,
        uri: str,
        name: str,
        log: Path,
        tag: str = "second",
    ) -> None:
        """Start it, its stderr going to *log*, its command saying *tag*."""
        self.oracle, self.log, self.tag = oracle, log, tag
        with log.open("a") as err:
            options = ("-v", "--uri", uri, *LEASE, "-n", name, "-w", "forever")
            self.process = spawn(*options, "--", *oracle.command(tag), stderr=err)

    def started(self) -> Run | None:
        """Return its command's run if it started; fail the test if lockrun exited instead."""
        if run := next((run for run in self.oracle.started(self.tag) if run.pid), None):
            return run
        if (status := self.process.poll()) is not None:
            pytest.fail(f"the contender exited {status}: {self.log.read_text()}")
        return None

    def wait_started(self, timeout: float, *logs: Path) -> Run:
        """Wait until its command runs; return the run."""
        if not until(self.started, timeout):
            pytest.fail(
                f"the contender did not start in {timeout:g}s\n"
                + evidence(self.oracle, *logs, self.log)
            )
        run = self.started()
        assert run is not None
        return run


def evidence(oracle: Oracle, *logs: Path) -> str:
    """Return the oracle's runs and the lockrun logs, for a failure's message."""
    runs = "\n".join(
        f"{run.tag or '?'}: pid {run.pid} fence {run.fence} start {run.start:.3f} "
        f"end {'-' if run.end is None else f'{run.end:.3f}'}"
        for run in oracle.runs
    )
    texts = "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs if log.exists())
    return f"{runs}\n{texts}"


def test_failover_never_runs_two_holders(
    sentinels: SentinelSet,
    oracle: Oracle,
    name: str,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """SENTINEL FAILOVER under a holder: it goes on on the new primary, or stops in time.

    A contender starts once every sentinel names the new primary. The holder either
    renews there (its lease reached the replica by WAIT before the promotion), and the
    contender gets in only after it is released, or it is stopped before the contender
    runs. Either way, the oracle never sees both at once.
    """
    holder_log, contender_log = tmp_path / "holder.err", tmp_path / "contender.err"
    uri = sentinels.uri()
    holder, first = oracle.hold(
        spawn, "holder", "-v", "--uri", uri, *LEASE, "-n", name, log=holder_log
    )
    time.sleep(TTL / 3 + 0.3)  # a renewal went through, replicated
    begun = time.monotonic()
    sentinels.failover()
    promoted = time.monotonic()
    contender = Contender(spawn, oracle, uri, name, contender_log)
    # Three leases: long enough for the holder's lease to end on the new primary, if the
    # holder could no longer renew it there; the contender could get in by then.
    survived = not until(lambda: first.end is not None or contender.started(), 3 * TTL)
    details = evidence(oracle, holder_log, contender_log)
    assert not oracle.overlaps(), details
    if survived:
        assert holder.poll() is None, details
        # Its lease on the failed-over primary would have ended by now: it renewed there.
        assert holder_pids(uri, name) == [holder.pid], details
        oracle.release(first)
        ended = oracle.wait_ended(first)
        assert holder.wait(10) == 0, evidence(oracle, holder_log)
    else:
        ended = oracle.wait_ended(first, timeout=1)
        holder.wait(KILL_AFTER + SLACK)
    # Sentinel re-points the old primary ~10-20 s after the failover; until it has synced,
    # the new primary may refuse grants.
    second = contender.wait_started(30, holder_log)
    details = evidence(oracle, holder_log, contender_log)
    # Survived: `ended` is its release, and the contender's start may wait for the lease
    # on the new primary to end (the release went to the old primary, still writable).
    record(
        "failover",
        survived=survived,
        failover_took=promoted - begun,
        ended_after=ended - begun,
        margin=second.start - ended,
        holder_status=holder.returncode,
    )
    assert not oracle.overlaps(), details
    assert second.start > ended, details
    assert second.fence > first.fence, details
    assert "Traceback" not in holder_log.read_text() + contender_log.read_text(), details
    if not survived:  # it could not confirm its lease: stopped, and said so
        assert holder.returncode == 76, details
        assert "lease could not be confirmed" in holder_log.read_text(), details
    oracle.release(second)
    assert contender.process.wait(10) == 0, evidence(oracle, contender_log)


def test_partitioned_primary_with_its_holder_never_runs_two_holders(
    split_sentinels: SentinelSet,
    namespace: Namespace,
    unix_oracle: UnixOracle,
    name: str,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """A primary cut off with its holder: the holder stops before the promoted replica grants.

    The primary and the holder run in a network namespace; the replica, the sentinels and
    the contender outside it. Once the link is down, the holder's primary stays writable,
    but no sentinel (and no replica) answers from its side, so no renewal counts and the
    command is stopped within the lease. The sentinels promote the replica; the contender
    gets the lock there, after the replicated lease ended.
    """
    sentinels, oracle = split_sentinels, unix_oracle
    holder_log, contender_log = tmp_path / "holder.err", tmp_path / "contender.err"
    old = sentinels.named()
    assert old is not None
    holder, first = oracle.hold(
        spawn,
        "holder",
        "-v",
        "--uri",
        sentinels.inner_uri,
        *LEASE,
        "-n",
        name,
        log=holder_log,
        under=namespace.prefix,
    )
    time.sleep(TTL / 3 + 0.3)  # a renewal went through, replicated
    namespace.cut()
    cut = time.monotonic()
    try:
        sentinels.wait_promoted(sentinels.other(old))
        promoted = time.monotonic()
        contender = Contender(spawn, oracle, sentinels.uri(), name, contender_log)

        def stopped() -> bool:
            contender.started()  # fails the test if it gave up
            return first.end is not None

        if not until(stopped, TTL + SLACK):
            pytest.fail("the holder's command ran on\n" + evidence(oracle, holder_log))
        ended = oracle.wait_ended(first, timeout=0)
        second = contender.wait_started(TTL + SLACK + 10, holder_log)
        holder.wait(KILL_AFTER + SLACK)
        details = evidence(oracle, holder_log, contender_log)
        margin = second.start - ended
        record(
            "partitioned primary",
            stopped_after=ended - cut,
            promoted_after=promoted - cut,
            margin=margin,
            holder_status=holder.returncode,
        )
        assert not oracle.overlaps(), details
        assert margin > 0, (
            f"the contender started {-margin:.3f}s before the holder ended\n{details}"
        )
        assert ended - cut < TTL, f"the command outlived its lease\n{details}"
        assert holder.returncode == 76, details
        assert "lease could not be confirmed" in holder_log.read_text(), details
        assert "Traceback" not in holder_log.read_text() + contender_log.read_text(), details
        assert second.fence > first.fence, details
    finally:
        namespace.heal()
    oracle.release(second)
    assert contender.process.wait(10) == 0, evidence(oracle, contender_log)


def test_a_lease_longer_than_the_reconfiguration_rides_out_a_failover(
    sentinels: SentinelSet,
    oracle: Oracle,
    name: str,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """A 30 s lease outlives a SENTINEL FAILOVER: the holder renews on the new primary.

    The new primary confirms nothing until it has a replica in sync (Sentinel re-points
    the old primary 8-11 s after the failover); a holder whose TERM is due later than
    that (0.9 ttl - kill-after after its last renewal, at least 16 s here) carries on
    there, a waiter waits, and nobody runs twice.
    """
    holder_log, contender_log = tmp_path / "holder.err", tmp_path / "contender.err"
    uri, ttl = sentinels.uri(), 30.0
    lease = ("--ttl", f"{ttl:g}", "--kill-after", "1", "-n", name)
    holder, first = oracle.hold(spawn, "holder", "-v", "--uri", uri, *lease, log=holder_log)
    begun = time.monotonic()
    new = sentinels.failover()
    (seconds, micros) = sentinels.nodes[new].command("TIME").split()
    failed_over_ms = int(seconds) * 1000 + int(micros) // 1000
    contender = Contender(spawn, oracle, uri, name, contender_log)
    key = f"lockrun:{{default/{name}}}:holders"
    old = sentinels.nodes[sentinels.other(new)]  # a replica of the new primary, in time

    def renewed_there() -> bool:
        """Whether a renewal on the new primary reached its replica: one that counted."""
        try:
            scores = old.command("ZRANGE", key, "0", "-1", "WITHSCORES").split()
        except subprocess.CalledProcessError:  # Sentinel re-pointing it drops its clients
            return False
        return len(scores) == 2 and float(scores[1]) > failed_over_ms + ttl * 1000

    if not until(lambda: renewed_there() or first.end is not None, ttl):
        pytest.fail("no renewal reached the new primary\n" + evidence(oracle, holder_log))
    renewed = time.monotonic()
    details = evidence(oracle, holder_log, contender_log)
    assert first.end is None, details
    assert contender.started() is None, details
    oracle.release(first)
    ended = oracle.wait_ended(first)
    assert holder.wait(10) == 0, evidence(oracle, holder_log)
    second = contender.wait_started(ttl + SLACK, holder_log)
    record("long lease", renewed_after=renewed - begun, handed_over_in=second.start - ended)
    assert not oracle.overlaps(), evidence(oracle, holder_log, contender_log)
    assert second.fence > first.fence
    oracle.release(second)
    assert contender.process.wait(10) == 0, evidence(oracle, contender_log)


def test_a_crashed_primary_never_runs_two_holders_and_waiters_wait_for_the_promotion(
    sentinels: SentinelSet,
    oracle: Oracle,
    name: str,
    spawn: Callable[..., Any],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """SIGKILL of the primary: the holder stops within its lease, waiters wait it out.

    The sentinels go on naming the dead primary until they promote the replica (down
    after 1 s, then an election): a queued waiter, and one started after the crash, both
    with -w forever, keep waiting while the sentinels answer, and get the lock on the new
    primary one after the other, once the replicated lease has run out there. In either
    order: a queue place written since the last WAIT may be lost with the primary
    (docs/backends.md), and then the waiter queues again, maybe behind the late one.
    """
    holder_log, contender_log = tmp_path / "holder.err", tmp_path / "contender.err"
    uri = sentinels.uri()
    holder, first = oracle.hold(
        spawn, "holder", "-v", "--uri", uri, *LEASE, "-n", name, log=holder_log
    )
    contender = Contender(spawn, oracle, uri, name, contender_log)
    wait_for(lambda: waiter_pids(uri, name) == [contender.process.pid], 30, "the waiter to queue")
    old = sentinels.named()
    assert old is not None
    sentinels.nodes[old].stop()  # SIGKILL
    crashed = time.monotonic()
    # One more, that never reached a primary: the sentinels answer, so it waits too.
    late_log = tmp_path / "late.err"
    late = Contender(spawn, oracle, uri, name, late_log, tag="late")
    ended = oracle.wait_ended(first, timeout=TTL + SLACK)
    waiters = (contender, late)
    if not until(lambda: any(waiter.started() for waiter in waiters), 30):
        pytest.fail("no waiter started in 30s\n" + evidence(oracle, holder_log, *logs(waiters)))
    went_first, went_next = waiters if contender.started() else waiters[::-1]
    second = went_first.wait_started(0)
    details = evidence(oracle, holder_log, *logs(waiters))
    record("crashed primary", stopped_after=ended - crashed, margin=second.start - ended)
    assert not oracle.overlaps(), details
    assert ended - crashed < TTL, details
    assert holder.wait(KILL_AFTER + SLACK) == 76, details
    assert second.fence > first.fence, details
    assert went_next.started() is None, details
    oracle.release(second)
    assert went_first.process.wait(10) == 0, evidence(oracle, went_first.log)
    third = went_next.wait_started(TTL + SLACK, went_next.log)
    assert third.fence > second.fence, details
    oracle.release(third)
    assert went_next.process.wait(10) == 0, evidence(oracle, went_next.log)
    assert not oracle.overlaps(), evidence(oracle, holder_log, *logs(waiters))


def logs(waiters: Sequence[Contender]) -> list[Path]:
    """Return the stderr logs of *waiters*."""
    return [waiter.log for waiter in waiters]
