"""The bench measures each peer the way its users see it (#32 "A fair bench first").

On real servers: a waiter on etcd, `etcdctl lock`'s or lockrun's, counts as queued only once
etcd has caught its watch up (released earlier, the waiter pays etcd's 100 ms catch-up, not a
hand-over), and the bench's servers keep their production durability (a flush lockrun forces
is in its figures). A host cut off in the hot-standby section is cut off from every server.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from bench import core
from bench.core import ETCD, ETCDCTL_LOCK, Bench, Broken, Processes
from bench.modes import through
from bench.servers import UNSYNCED, WATCHERS, Etcd, launch, serving
from tests.support.servers import free_port

if TYPE_CHECKING:
    from pathlib import Path

TRIALS = 5  # waiters queued one after another; each is looked at until it counts as queued


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    return Bench([sys.executable, "-m", "lockrun"], tmp_path, core.QUICK)


@pytest.mark.slow  # an etcd, five waiters
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [ETCDCTL_LOCK, ETCD])
def test_an_etcd_waiter_counts_as_queued_only_with_its_watch_synced(
    bench: Bench, kind: str
) -> None:
    """Each time `waiting` first says queued, etcd's gauges it read showed the watch synced.

    Looked at as fast as the bench can, from the moment the waiter starts: the first yes
    comes only from a reading of etcd's own gauges with the waiter's watch there and caught
    up, which a key count alone never waited for (a watch can go unsynced again later, so
    the reading that decided is the one checked).
    """
    with serving(bench, ETCD) as server:
        assert isinstance(server, Etcd)
        assert server.gauges() == {WATCHERS: 0.0, UNSYNCED: 0.0}  # idle: read from etcd itself
        readings: list[dict[str, float]] = []
        read = server.gauges

        def noted() -> dict[str, float]:
            readings.append(read())
            return readings[-1]

        server.gauges = noted  # type: ignore[method-assign]
        for trial in range(TRIALS):
            scenario = bench.scenario_dir(f"trial{trial}")
            target = bench.target(kind, scenario)
            with Processes(scenario) as procs:
                go = bench.start_holders(procs, target, 1, core.HANDOFF_POLL)
                waiter = procs.spawn(target.argv("true", wait=True))
                readings.clear()
                while not server.waiting(target, {waiter.pid}):
                    assert waiter.poll() is None, procs.stderr_of(waiter)
                assert readings, "queued without a look at etcd's watches"
                assert readings[-1][UNSYNCED] == 0
                assert readings[-1][WATCHERS] >= 1
                go.touch()
                procs.finish(30.0)


@pytest.mark.slow  # three servers started
@pytest.mark.timeout(180)
def test_the_bench_servers_keep_production_durability() -> None:
    """PostgreSQL fsyncs, MariaDB flushes per commit, etcd's data is on disk, Redis has an AOF."""
    postgres = launch("postgres", free_port())
    try:
        assert postgres.query("SHOW fsync") == [("on",)]
        assert postgres.query("SHOW synchronous_commit") == [("on",)]
    finally:
        postgres.close()
    maria = launch("mysql", free_port())
    try:
        found = maria.query("SELECT @@innodb_flush_log_at_trx_commit")
        assert found == [(1,)]
    finally:
        maria.close()
    etcd = launch(ETCD, free_port())
    try:
        mounts = subprocess.run(
            ["stat", "-f", "-c", "%T", etcd.server.directory],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert mounts != "tmpfs"
    finally:
        etcd.close()
    redis = launch("redis", free_port())
    try:
        config = redis.ask(lambda probe: probe.config_get("append*"))
        assert config["appendonly"] == "yes"
        assert config["appendfsync"] == "everysec"
    finally:
        redis.close()


@pytest.mark.parametrize(
    ("uri", "proxied"),
    [
        ("redis://127.0.0.1:2379/0", "redis://127.0.0.1:9/0"),
        (
            "postgresql://u@127.0.0.1:2379/db?sslmode=disable",
            "postgresql://u@127.0.0.1:9/db?sslmode=disable",
        ),
        ("etcd://127.0.0.1:2379", "etcd://127.0.0.1:9"),
        ("etcd://127.0.0.1:2379,127.0.0.1:23790", "etcd://127.0.0.1:9,127.0.0.1:23790"),
        ("etcd://127.0.0.1:23790,127.0.0.1:2379", "etcd://127.0.0.1:23790,127.0.0.1:9"),
    ],
)
def test_the_cut_off_host_reaches_its_server_only_through_the_proxy(uri: str, proxied: str) -> None:
    """The server's port, wherever it ends the address, becomes the proxy's; never a longer one."""
    assert through(uri, 2379, 9) == proxied


def test_a_uri_without_the_servers_port_is_broken_not_left_direct() -> None:
    """A URI the proxy cannot be put into is a bench problem: the cut would cut nothing."""
    with pytest.raises(Broken, match="no port 2379"):
        through("etcd://127.0.0.1:23790", 2379, 9)


@pytest.mark.slow  # an etcd, three lockruns
@pytest.mark.timeout(120)
def test_etcd_counts_each_lockrun_waiters_call_and_watch_connections(bench: Bench) -> None:
    """Two queued waiters: 2 connections each (calls, watch) beside the holder's 2; 3 watches.

    The holder's: its calls', and its take-over bell's watch (docs/design.md A13). etcd's
    gateway speaks to etcd over a connection of its own, which is no client's.
    """
    with serving(bench, ETCD) as server:
        assert isinstance(server, Etcd)
        assert server.clients() == (0, 0)
        scenario = bench.scenario_dir("connections")
        target = bench.target(ETCD, scenario)
        with Processes(scenario) as procs:
            go = bench.start_holders(procs, target, 1, core.IDLE_POLL)
            waiters = [procs.spawn(target.argv("true", wait=True)) for _ in range(2)]
            bench.wait_queued(procs, target, waiters)
            assert server.clients() == (server.held_by(1) + server.sessions(2, 1), 3)
            go.touch()
            procs.finish(30.0)
