"""Hot standbys: `lockrun --wait forever -- daemon` on three "hosts", the daemon on one of them.

docs/semantics.md, "One active daemon, hot standbys": "When the active one stops, the next
standby's daemon starts", after a clean stop "within milliseconds", after a crash at once
(on Redis "after what remains of the lease, at most `--ttl`"), and after the active host is
cut off "once the service lets the lock go [...] The cut-off lockrun has stopped its daemon
before then ([A lost lock](#a-lost-lock)), so the two never run at once". None of these
faults is one of the rows of "Faults: what can still overlap, and by how much" that allow an
overlap (a lock *known* lost, at most `--lost-kill-after`): the daemons must never overlap.

Each daemon is an oracle command (tests/support/oracle.py): the kernel tells the oracle when
it started and when it ended, whatever killed it. Three standbys queue in turn; the active
one is stopped (TERM), crashed (SIGKILL of lockrun and the daemon's process group) or cut
off (each host has a link of its own to the server, a `Proxy`, silenced), twice per test,
and one standby must take over alone, within a bound derived from the ttl: SLACK after a
clean stop or a crash, ttl + SLACK after a crash on Redis (the lease runs out), the server's
idle limit for a ttl + SLACK after a cut. After a stop or a cut it is the next in arrival
order. After a crash it may not be on abstract:, where the queue is the dead holder's accept
backlog and the standbys race to bind the freed name (measured: `in_order`). The fail-over
times are printed at the end of the run (`record`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

import pytest

from tests.support.cli import holder_pids, wait_for, waiter_pids
from tests.support.harness import LEASE, SLACK, TTL, check_lost
from tests.support.proxy import Proxy

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

    from tests.support.harness import Harness
    from tests.support.oracle import Oracle, Run


# A server of its own per partition test, three lockruns at a time: slow, not CPU-bound.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HOSTS: Final = 3
# How long past a bound we still wait for the next daemon, to tell "late" from "never".
PATIENCE: Final = 30.0


@dataclass
class Host:
    """One standby: its lockrun (stderr in *log*) and, once it runs, its daemon's run."""

    tag: str
    process: subprocess.Popen[str]
    log: Path
    run: Run | None = None

    @property
    def daemon(self) -> Run:
        """The daemon's run (it must have started)."""
        assert self.run is not None, f"{self.tag}'s daemon never started"
        return self.run


def evidence(oracle: Oracle, hosts: Sequence[Host]) -> str:
    """Return the oracle's runs and every lockrun's stderr, for a failure's message."""
    runs = "\n".join(
        f"{run.tag or '?'}: pid {run.pid} lockrun {run.ppid} fence {run.fence} "
        f"start {run.start:.3f} end {'-' if run.end is None else f'{run.end:.3f}'}"
        for run in oracle.runs
    )
    logs = "\n".join(
        f"--- {host.tag} (lockrun {host.process.pid}, status {host.process.poll()}):\n"
        + host.log.read_text()
        for host in hosts
        if host.log.exists()
    )
    return f"{runs}\n{logs}"


def start_standbys(
    spawn: Callable[..., subprocess.Popen[str]],
    oracle: Oracle,
    tmp_path: Path,
    name: str,
    status_uri: str,
    uris: Sequence[str],
) -> list[Host]:
    """Start a standby per URI, in turn: the first runs its daemon, the others queue behind.

    Each is ``lockrun --uri URI --ttl 3 --kill-after 1 -n NAME -w forever -- daemon``, as in
    docs/deployment.md "Hot standby", its daemon an oracle command. A standby counts as
    started once `lockrun status` (asked at *status_uri*) lists it as a waiter.
    """
    hosts: list[Host] = []
    for index, uri in enumerate(uris):
        tag, log = f"host{index}", tmp_path / f"host{index}.err"
        options = ("--uri", uri, *LEASE, "-n", name, "-w", "forever")
        if not hosts:  # a 69 while the machine is loaded is tried again, under a new tag
            process, run = oracle.hold(spawn, tag, *options, log=log)
            hosts.append(Host(run.tag, process, log, run))
            continue
        with log.open("a") as err:
            process = spawn(*options, "--", *oracle.command(tag), stderr=err)
        host = Host(tag, process, log)
        hosts.append(host)

        def queued(host: Host = host) -> bool:
            if host.process.poll() is not None:
                pytest.fail(f"{host.tag} exited {host.process.returncode}\n{host.log.read_text()}")
            return host.process.pid in waiter_pids(status_uri, name)

        wait_for(queued, PATIENCE, f"{tag} to queue")
    assert oracle.running == 1, evidence(oracle, hosts)
    return hosts


def take_over(
    oracle: Oracle,
    hosts: Sequence[Host],
    queue: list[Host],
    since: float,
    bound: float,
    *,
    in_order: bool = True,
) -> tuple[Host, float]:
    """Wait for a standby of *queue* to start its daemon; return it and how long after *since*.

    It leaves *queue*. *in_order*: it must be the first of *queue* (FIFO). Fails the test if
    two start, or one starts *bound* seconds or more after *since*, or none does.
    """

    def started() -> list[Host]:
        return [host for host in queue if any(run.pid for run in oracle.started(host.tag))]

    oracle.wait(started, bound + PATIENCE, "a standby to start")
    (successor, *others) = started()
    details = evidence(oracle, hosts)
    assert not others, details
    assert not in_order or successor is queue[0], f"{successor.tag} overtook\n{details}"
    successor.run = oracle.wait_started(successor.tag, timeout=0)
    queue.remove(successor)
    took = successor.daemon.start - since
    assert took < bound, f"{successor.tag} started {took:.3f}s on, not within {bound:g}s\n" + (
        details
    )
    return successor, took


def check_one_active(
    oracle: Oracle,
    hosts: Sequence[Host],
    status_uri: str,
    name: str,
    active: Host,
    queue: list[Host],
) -> None:
    """Check *active*'s daemon runs alone, its lockrun holds the lock, and *queue* waits."""
    details = evidence(oracle, hosts)
    assert oracle.running == 1, details
    assert active.daemon.end is None, details
    assert active.daemon.ppid == active.process.pid, details
    wait_for(
        lambda: holder_pids(status_uri, name) == [active.process.pid],
        PATIENCE,
        f"status to name {active.tag} the holder",
    )
    assert waiter_pids(status_uri, name) == [host.process.pid for host in queue], details


def check_never_two(oracle: Oracle, hosts: Sequence[Host]) -> None:
    """Check no two daemons ever ran at once, and each later one has a larger fence."""
    details = evidence(oracle, hosts)
    assert not oracle.overlaps(), details
    assert oracle.peak == 1, details
    fences = [host.daemon.fence for host in sorted(hosts, key=lambda host: host.daemon.start)]
    assert fences == sorted(set(fences)), details


def finish(oracle: Oracle, hosts: Sequence[Host], last: Host) -> None:
    """Let the *last* daemon end on its own: its lockrun exits 0, nothing left running."""
    oracle.release(last.daemon)
    oracle.wait_ended(last.daemon)
    assert last.process.wait(PATIENCE) == 0, evidence(oracle, hosts)
    check_never_two(oracle, hosts)


def test_a_clean_stop_hands_over_to_the_next_standby(
    shared_harness: Harness,
    oracle: Oracle,
    name: str,
    spawn: Callable[..., subprocess.Popen[str]],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """TERM to the active lockrun (systemctl stop): the next standby starts, by a hand-over.

    lockrun forwards TERM to the daemon and releases once it has exited (it exits 143 as the
    daemon did): no lease is waited out, on any backend.
    """
    uri = shared_harness.uri
    hosts = start_standbys(spawn, oracle, tmp_path, name, uri, [uri] * HOSTS)
    active, queue, times = hosts[0], hosts[1:], []
    while queue:
        active.process.send_signal(signal.SIGTERM)
        ended = oracle.wait_ended(active.daemon, timeout=PATIENCE)
        successor, took = take_over(oracle, hosts, queue, ended, SLACK)
        assert active.process.wait(PATIENCE) == 128 + signal.SIGTERM, evidence(oracle, hosts)
        said = active.log.read_text()
        assert "Traceback" not in said, evidence(oracle, hosts)
        assert "internal error" not in said, evidence(oracle, hosts)
        check_one_active(oracle, hosts, uri, name, successor, queue)
        active = successor
        times.append(took)
    record("clean stop: fail-over s (daemon end -> next start)", first=times[0], second=times[1])
    finish(oracle, hosts, active)


def test_a_crash_hands_over_once_the_lock_is_free(
    shared_harness: Harness,
    oracle: Oracle,
    name: str,
    spawn: Callable[..., subprocess.Popen[str]],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """SIGKILL of the active lockrun and its daemon's group (OOM, a crash): the next starts.

    On file:, abstract:, MySQL and PostgreSQL the lock is freed as the processes die; on
    Redis the next standby starts once the lease runs out, at most a ttl after the crash.
    """
    uri = shared_harness.uri
    hosts = start_standbys(spawn, oracle, tmp_path, name, uri, [uri] * HOSTS)
    # A lease outlives its holder by what is left of it; a session or a file does not.
    bound = SLACK + (0 if shared_harness.kind.local or shared_harness.kind.session else TTL)
    active, queue, numbers = hosts[0], hosts[1:], dict[str, object]()
    for round_ in range(1, HOSTS):
        group = os.getpgid(active.daemon.pid)
        assert group != os.getpgid(0)  # never our own
        active.process.kill()
        with contextlib.suppress(ProcessLookupError):  # the guardian may have been first
            os.killpg(group, signal.SIGKILL)
        ended = oracle.wait_ended(active.daemon, timeout=PATIENCE)
        # Not necessarily the next in arrival order: on abstract: the queue is the dead
        # holder's accept backlog, and the standbys race to bind the freed name.
        next_in_line = queue[0]
        successor, took = take_over(oracle, hosts, queue, ended, bound, in_order=False)
        assert active.process.wait(PATIENCE) == -signal.SIGKILL
        check_one_active(oracle, hosts, uri, name, successor, queue)
        active = successor
        numbers |= {f"failover_{round_}": took, f"in_order_{round_}": successor is next_in_line}
    record("crash: fail-over s (daemon end -> next start)", **numbers)
    finish(oracle, hosts, active)


class Link(NamedTuple):
    """How one host reaches the server, and how to cut it off (None: it is never cut)."""

    uri: str
    cut: Callable[[], None] | None


@pytest.fixture
def links(server_harness: Harness) -> Iterator[list[Link]]:
    """Return three hosts' links to the harness's server: two through proxies, one direct.

    The first host's link is the harness's own proxy (`partition` silences it), the second
    a proxy of the test's own; the last host reaches the server directly.
    """
    assert server_harness.proxy is not None
    assert server_harness.proxied is not None
    proxy = Proxy(server_harness.proxy.target)
    port = server_harness.proxy.target[1]
    own = server_harness.uri.replace(f":{port}/", f":{proxy.port}/")
    assert own != server_harness.uri
    yield [
        Link(server_harness.proxied, server_harness.partition),
        Link(own, proxy.blackhole),
        Link(server_harness.uri, None),
    ]
    proxy.close()


def test_a_host_cut_off_stops_its_daemon_before_the_next_starts(
    server_harness: Harness,
    links: list[Link],
    oracle: Oracle,
    name: str,
    spawn: Callable[..., subprocess.Popen[str]],
    record: Callable[..., None],
    tmp_path: Path,
) -> None:
    """The active host's link goes silent: its lockrun stops the daemon (76), then the next runs.

    Nothing tells the server; it frees the lock a lease after the holder's last word (Redis:
    the lease; MySQL, PostgreSQL: the session's idle limit). The cut-off lockrun KILLs its
    daemon by 0.9 ttl after its last good renewal, before that. Two cuts per test: the first
    host's link (the harness's proxy), then the second's (a proxy of its own).
    """
    rig, uri = server_harness, server_harness.uri
    hosts = start_standbys(spawn, oracle, tmp_path, name, uri, [link.uri for link in links])
    bound = rig.free_after(TTL) + SLACK
    numbers: dict[str, object] = {}
    active, queue = hosts[0], hosts[1:]
    for index, link in enumerate(links[:-1], start=1):
        # A renewal went through since the grant (or since the daemon started).
        time.sleep(max(0.0, TTL / 3 + 0.3 - active.daemon.length))
        assert link.cut is not None
        link.cut()
        cut_at = time.monotonic()  # the oracle's clock
        ended = oracle.wait_ended(active.daemon, timeout=TTL + PATIENCE)
        successor, took = take_over(oracle, hosts, queue, cut_at, bound)
        details = evidence(oracle, hosts)
        status = active.process.wait(PATIENCE)
        check_lost(status, active.log.read_text(), name)
        assert ended - cut_at < TTL, f"the cut-off daemon outlived its lease\n{details}"
        assert successor.daemon.start > ended, details
        numbers |= {
            f"stopped_after_{index}": ended - cut_at,
            f"failover_{index}": took,
            f"margin_{index}": successor.daemon.start - ended,
        }
        check_one_active(oracle, hosts, uri, name, successor, queue)
        active = successor
    record("cut off: s after the cut (daemon stopped, next started)", **numbers)
    finish(oracle, hosts, active)
