"""Benchmark lockrun: startup, handoff latency, idle waiters' CPU, FIFO order, fleet modes.

``python -m bench [--quick]``, from the repository root, prints one report; a missed target is
a MISS line. Each measurement is one function, run for the local backends, then for each server
backend on a throwaway server of its own (bench/servers.py). The Python API is measured beside
its peers, each contender in a process of its own (bench/api.py); hot-standby fail-overs and
the cost of each mode (--shared, --hold-at-least, --take-over) in bench/modes.py. It exits 1
only when something broke (lockrun crashed, hung or exited as it should not), listed at the
end with its command; a mode a backend does not implement is an UNSUPPORTED line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import string
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, NamedTuple
from urllib.parse import urlsplit

from bench import api, core, modes, reach
from bench.core import (
    ETCD,
    ETCDCTL_LOCK,
    FLOCK,
    SERVED,
    SOCKET,
    Bench,
    Broken,
    Processes,
    Usage,
    row,
)
from bench.servers import Unavailable, serving

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

    from bench.core import ApiEffort, Effort, Target

APPEND_SCRIPT: Final = 'echo "$1 ${LOCKRUN_FENCE:-}" >> "$2"'  # $1 index, $2 order file
FIFO_SPACING: Final = 0.1
LONG_HOLD: Final = 6.0  # a wait of seconds, as in real use, not only a fresh queue
# Start-up: a local backend's over importing click (a click program's least), a server
# backend's over its floor (FLOORS); issue 32's targets.
LOCAL_STARTUP_TARGET: Final = 1.15
SERVER_STARTUP_TARGET: Final = 1.05
FILE_HANDOFF_RATIO: Final = 1.3
# lockrun's handoff over `etcdctl lock`'s: issue 32's for Redis and the SQL servers; on etcd
# itself, the same work on the same server (issue 33), only lockrun's own cost above it.
ETCD_HANDOFF_RATIO: Final = 1.2
ETCD_HANDOFF_RATIOS: Final = {ETCD: 1.0}
OTHER_HANDOFF_MS: Final = 10.0
SLOTS: Final = (1, 3)
# What lockrun's start-up is divided by: the interpreter importing click and the driver,
# then connecting and one round trip; for the local backends, importing click and a flock(2).
# Each floor connects the cheapest way that does what lockrun's connection does: PyMySQL's
# default connect loads the system's CA store for a TLS it offers (≈20 ms) that lockrun,
# asked for no TLS, skips, so the floor skips it too. etcd's driver is lockrun's own HTTP over
# a socket (docs/design.md A13), so the floor is the least of that: one POST of a range read
# written by hand on a socket with TCP_NODELAY (as lockrun's), the headers read to the blank
# line and the JSON answer by its Content-Length. (`http.client` would be a heavier floor,
# 2.9 MiB and ms of import that lockrun no longer pays: a ratio against it flatters lockrun.)
DRIVERS: Final = {
    "redis": "redis",
    "mysql": "pymysql",
    "postgres": "psycopg",
    ETCD: "json, base64, socket",
}
ETCD_FLOOR: Final = (
    "s = socket.create_connection(({host!r}, {port})); "
    "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); "
    "b = json.dumps({{'key': base64.b64encode(b'floor').decode()}}).encode(); "
    "s.sendall(b'POST /v3/kv/range HTTP/1.1\\r\\nHost: h\\r\\nContent-Length: %d\\r\\n\\r\\n'"
    " % len(b) + b); "
    "f = s.makefile('rb'); h = list(iter(f.readline, b'\\r\\n')); "
    "n = int(next(x for x in h if x.lower().startswith(b'content-length')).split(b':')[1]); "
    "json.loads(f.read(n))"
)
FLOORS: Final = {
    "redis": ("PING", "redis.Redis.from_url({uri!r}).ping()"),
    "mysql": ("SELECT 1", "pymysql.connect(**{mysql!r}, ssl_disabled=True).query('SELECT 1')"),
    "postgres": ("SELECT 1", "psycopg.connect({uri!r}).execute('SELECT 1')"),
    ETCD: ("POST /v3/kv/range", ETCD_FLOOR),
}
LOCAL_FLOOR: Final = "fcntl.flock(os.open({path!r}, os.O_RDWR | os.O_CREAT, 0o600), fcntl.LOCK_EX)"
TITLES: Final = {"redis": "Redis", "mysql": "MySQL", "postgres": "PostgreSQL", ETCD: "etcd"}
# The Python API: lockrun at most this many times its peer's acquire+release median.
API_TARGETS: Final = {
    "file": (api.PORTALOCKER, 1.5),
    "abstract": (api.PORTALOCKER, 2.0),
    "redis": (api.REDIS_LOCK, 1.3),
    "mysql": (api.GET_LOCK, 2.5),
    "postgres": (api.ADVISORY, 2.5),
    # etcd3gw's Lock, OpenStack's client of the same gateway: a library's lock, as redis-py's
    # is on Redis (issue 32's 1.3x). It cannot wait: no contention round (bench/api.py).
    ETCD: (api.ETCD3GW, 1.3),
}
CONTENDING: Final = 4  # processes on one name
# lockrun's cycles/s, at least this share of the primitive's, as issue 32 reads it: the raw
# GET_LOCK and advisory lock; on Redis, where SET NX cannot wait, redis-py's lock, which polls
# it; on a file, portalocker's flock(2) (a bare open+flock+close is printed beside it); on etcd,
# its own lock service (v3lock: the same queue, run by the server) on a lease per cycle.
THROUGHPUT_SHARE: Final = 0.5
RAW: Final = {
    "file": api.PORTALOCKER,
    "abstract": api.PORTALOCKER,
    "redis": api.REDIS_LOCK,
    "mysql": api.GET_LOCK,
    "postgres": api.ADVISORY,
    ETCD: api.V3LOCK,
}
PSS_TARGET: Final = 12.0  # MiB of memory a waiting lockrun (its process tree) may cost
FAIRNESS: Final = 0.85  # lockrun's fewest cycles per process over its most: FIFO, in turn
API_TIMEOUT: Final = 120.0


def imports(backends: Iterable[str]) -> str:
    """Return what `python -c 'import …'` imports for *backends*: click and their drivers."""
    return ", ".join(["click", *(DRIVERS[b] for b in backends if b in DRIVERS)])


@dataclass(frozen=True)
class Group:
    """Backends measured in the same four sections: the local ones, or one server's."""

    backends: tuple[str, ...]
    effort: Effort
    title: str  # "" for the local backends
    letters: tuple[str, ...]  # of its sections

    @classmethod
    def all(cls, bench: Bench) -> list[Group]:
        found = [(core.LOCAL, "")] + [((backend,), TITLES[backend]) for backend in SERVED]
        # a to z, then aa, ab, …: four groups of eight sections need more than 26
        letters = (
            *string.ascii_lowercase,
            *map("".join, itertools.product(string.ascii_lowercase, repeat=2)),
        )
        return [
            cls(backends, bench.plan.efforts[backends[0]], title, letters[len(SECTIONS) * i :])
            for i, (backends, title) in enumerate(found)
        ]

    @property
    def name(self) -> str:
        """What `--only` calls the group: local, or the server backend's name."""
        return self.backends[0] if self.title else "local"

    def heading(self, index: int, what: str) -> None:
        title = f"{self.title} {what}" if self.title else what[0].upper() + what[1:]
        core.section(f"({self.letters[index]}) {title}")


# What `--only` selects: the four groups' sections, and the one-file and monitoring ones.
GROUPS: Final = ("local", *SERVED, "reach")


def startup_medians(
    bench: Bench, commands: dict[str, list[str]], runs: int, what: str
) -> dict[str, float] | None:
    """Run every command *runs* times, round-robin after a warm-up; return median wall times."""
    times: dict[str, list[float]] = {label: [] for label in commands}
    quiet = subprocess.DEVNULL
    try:
        for attempt in range(runs + 1):
            for label, argv in commands.items():
                began = time.perf_counter()
                subprocess.run(argv, check=True, stdin=quiet, stdout=quiet, stderr=quiet)
                if attempt > 0:  # the first round warms the page cache
                    times[label].append(time.perf_counter() - began)
    except subprocess.CalledProcessError as err:
        bench.broke(what, Broken(f"exit {err.returncode} from {shlex.join(err.cmd)}"))
        return None
    return {label: statistics.median(values) for label, values in times.items()}


def floor(backend: str, target: Target) -> tuple[str, list[str]]:
    """Return what *backend*'s start-up is divided by: a label and its `python -c` command.

    The command imports click and the driver, connects and makes one round trip (PING, SELECT
    1, a range read): what any command-line client of the server must do. For the local
    backends: importing click and one open and flock(2).
    """
    what, code = FLOORS.get(backend, ("open+flock", LOCAL_FLOOR))
    parts = urlsplit(target.uri)
    mysql = {"host": parts.hostname, "port": parts.port, "user": parts.username}
    mysql["database"] = parts.path.lstrip("/")
    where = {"host": parts.hostname, "port": parts.port}
    code = code.format(uri=target.uri, path=str(target.directory / "floor"), mysql=mysql, **where)
    modules = imports([backend]) + ("" if backend in DRIVERS else ", fcntl, os")
    label = f"import, connect, {what}" if backend in DRIVERS else f"import click, {what}"
    return f"floor: {label}", [sys.executable, "-c", f"import {modules}; {code}"]


def startup(bench: Bench, group: Group) -> None:
    """Compare `lockrun … -- true` with its floor, with importing click and with flock(1)."""
    runs = group.effort.startup_runs
    group.heading(0, f"startup: median wall time of {runs} runs each")
    scenario = bench.scenario_dir("startup")
    commands: dict[str, list[str]] = {}
    lockruns: dict[str, str] = {}  # by backend, the label of `lockrun … -- true`
    floors: dict[str, str] = {}  # by backend, the label of its floor's command
    for backend in group.backends:
        lock = bench.target(backend, scenario)
        if (server := bench.server_of(backend)) is not None:
            try:
                row("server", f"{server.program} {server.version()}, {server.uri}")
            except Broken as err:
                bench.broke(f"{backend} startup", err)
                return
            row("server start", f"{server.ready_in:.1f} s: a fresh data directory, then a session")
            row("durability", server.durability)
        shown = "file:DIR" if backend == "file" else lock.uri.split(":")[0] + ":"
        lockruns[backend] = f"lockrun --uri {shown}{'//…' if server else ''} -- true"
        floors[backend], floor_command = floor(backend, lock)
        commands |= {lockruns[backend]: lock.argv("true"), floors[backend]: floor_command}
    modules = dict.fromkeys((imports(group.backends), "click"))  # for reference
    for module in modules:
        commands[f"python -c 'import {module}'"] = [sys.executable, "-c", f"import {module}"]
    commands["python -c pass"] = [sys.executable, "-c", "pass"]
    commands["flock DIR/x true"] = [FLOCK, str(scenario / "x"), "true"]
    if (medians := startup_medians(bench, commands, runs, "startup")) is None:
        return
    for label, median in medians.items():
        row(label, f"{median * 1000:7.1f} ms")
    for backend, label in lockruns.items():
        prefix, mine = f"{backend}: " if len(group.backends) > 1 else "", medians[label]
        served = bench.server_of(backend) is not None
        target = None if not served else SERVER_STARTUP_TARGET
        core.ratio_row(f"{prefix}lockrun / floor", mine / medians[floors[backend]], target)
        for module in modules:
            ratio = mine / medians[f"python -c 'import {module}'"]
            most = LOCAL_STARTUP_TARGET if not served and module == "click" else None
            core.ratio_row(f"{prefix}lockrun / import {module}", ratio, most)
        row(f"{prefix}lockrun / flock(1)", f"{mine / medians['flock DIR/x true']:5.1f}x")


def handoff_trials(
    bench: Bench, labels: dict[str, str], trials: int
) -> tuple[dict[str, list[float]], set[str]]:
    """Time *trials* handoffs (holder's command exits -> waiter's starts) of each kind, in ms."""
    results: dict[str, list[float]] = {kind: [] for kind in labels}
    broken: set[str] = set()
    for kind in (kind for _ in range(trials) for kind in labels if kind not in broken):
        scenario = bench.scenario_dir(f"handoff-{kind}")
        target = bench.target(kind, scenario)
        end, start = scenario / "END", scenario / "START"
        try:
            with Processes(scenario) as procs:
                go = bench.start_holders(procs, target, 1, core.HANDOFF_POLL, out=end)
                waiter = procs.spawn(target.argv("date", "+%s%N", wait=True), stdout=start)
                bench.wait_queued(procs, target, [waiter])
                go.touch()
                procs.finish(10.0)
        except Broken as err:
            broken.add(kind)
            bench.broke(f"handoff {labels[kind]}", err)
            continue
        results[kind].append((int(start.read_text()) - int(end.read_text())) / 1e6)
    return results, broken


def start_etcd(bench: Bench, stack: contextlib.ExitStack) -> bool:
    """Run a throwaway etcd until *stack* closes, for `etcdctl lock`; say whether it runs.

    On the etcd group, `etcdctl lock` runs on lockrun's own etcd: the same server.
    """
    try:
        if ETCD in bench.servers:
            row("etcdctl lock", "on the same etcd as lockrun")
        else:
            stack.enter_context(serving(bench, ETCD))
            etcd = bench.servers[ETCD]
            numbers = f"etcd {etcd.version()}, {etcd.endpoint}, started in {etcd.ready_in:.1f} s"
            row("etcd", numbers)
            row("etcd durability", etcd.durability)
        row("etcdctl waiter queued", "once etcd counts its watch, synced (servers.Etcd.waiting)")
    except (Unavailable, Broken) as err:
        row("etcdctl lock", f"skipped: {err}")
        return False
    return True


def handoff(bench: Bench, group: Group) -> None:
    """Time handoffs of each backend (and a server's socket) against flock(1), interleaved.

    A server backend's are timed beside `etcdctl lock`'s too, on a throwaway etcd.
    """
    trials = group.effort.handoff_trials
    group.heading(1, f"handoff: holder's command exits -> waiter's command starts, {trials} trials")
    labels: dict[str, str | None] = {}  # None: skipped with --quick
    for backend in group.backends:
        server = bench.server_of(backend)
        labels[backend] = f"lockrun, {backend} backend" + (" (TCP)" if server else "")
        if server and server.sockets:
            socket = None if bench.plan.quick else f"lockrun, {backend} backend (socket)"
            labels[backend + SOCKET] = socket
    labels["flock"] = "flock(1) on a file"
    with contextlib.ExitStack() as stack:
        if group.title and start_etcd(bench, stack):
            labels[ETCDCTL_LOCK] = "etcdctl lock (TCP)"
        measured = {kind: label for kind, label in labels.items() if label is not None}
        results, broken = handoff_trials(bench, measured, trials)
    for kind, label in labels.items():
        if label is None:
            row(f"{kind.removesuffix(SOCKET)} backend (socket)", "skipped with --quick")
        elif kind not in broken:
            row(label, core.describe(results[kind], tail=kind != "flock"))
            if kind in group.backends:
                slowest = sorted(results[kind], reverse=True)[:3]
                row(f"{kind}: slowest three", "  ".join(f"{ms:.2f}" for ms in slowest) + " ms")
    medians = {kind: statistics.median(results[kind]) for kind in measured if kind not in broken}
    for backend in (backend for backend in group.backends if backend in medians):
        handoff_verdicts(backend, medians)


def handoff_verdicts(backend: str, medians: dict[str, float]) -> None:
    """Judge *backend*'s handoff median: against flock(1)'s for file, else against etcdctl's."""
    median, flock, etcd = medians[backend], medians.get("flock"), medians.get(ETCDCTL_LOCK)
    if backend == "file":  # both flock(2): lockrun's own cost, over flock(1)'s
        if flock:
            core.ratio_row("file: lockrun / flock(1), median", median / flock, FILE_HANDOFF_RATIO)
        return
    if flock:
        core.ratio_row(f"{backend}: lockrun / flock(1)", median / flock)
    ok = median <= OTHER_HANDOFF_MS
    row(f"{backend}: median", f"{median:6.2f} ms", f"<= {OTHER_HANDOFF_MS:.0f} ms", ok)
    if etcd:
        most = ETCD_HANDOFF_RATIOS.get(backend, ETCD_HANDOFF_RATIO)
        core.ratio_row(f"{backend}: lockrun / etcdctl lock", median / etcd, most)


@dataclass(frozen=True)
class IdleResult:
    """What the idle waiters (and their server) cost during the window, and the drain."""

    usage: Usage
    processes: int  # the waiters and their children
    pss: float  # MiB of memory, summed over their process trees (smaps_rollup)
    drain: float
    server: Usage | None = None
    connected: int = 0  # the server's clients at the window's end, without the probe
    blocked: int = 0  # waiting (in BLPOP, GET_LOCK, pg_advisory_lock; etcd: its watches)
    left: int = 0  # the server's connections once every waiter had run and exited


def idle_case(
    bench: Bench, kind: str, slots: int, waiters: int, window: float
) -> IdleResult | None:
    """Hold *slots* slots, queue waiters, measure their CPU (and the server's); None: broke."""
    scenario = bench.scenario_dir(f"idle-{kind}-{slots}")
    target, server = bench.target(kind, scenario), bench.server_of(kind)
    try:
        with Processes(scenario) as procs:
            go = bench.start_holders(procs, target, slots, core.IDLE_POLL)
            command = target.argv("true", slots=slots, wait=True)
            queue = [procs.spawn(command) for _ in range(waiters)]
            bench.wait_queued(procs, target, queue, timeout=60.0)
            time.sleep(0.3)  # let the last starters finish whatever they do after queueing
            before = core.family_usage(proc.pid for proc in queue)
            server_start = None if server is None else server.usage()
            time.sleep(window)
            after = core.family_usage(proc.pid for proc in queue)
            result = IdleResult(core.spent(before, after), len(after), core.pss(after), 0.0)
            if server is not None and server_start is not None:
                load = server.usage() - server_start
                connected, blocked = server.clients()
                result = replace(result, server=load, connected=connected, blocked=blocked)
            go.touch()
            began = time.monotonic()
            procs.finish(60.0)
            result = replace(result, drain=time.monotonic() - began)
        if server is None:
            return result
        core.poll_until(lambda: server.clients()[0] == 0, 2.0, 0.01)  # a close lands later
        return replace(result, left=server.clients()[0])
    except (Broken, FileNotFoundError, ProcessLookupError) as err:
        problem = err if isinstance(err, Broken) else Broken(f"waiter vanished: {err}")
        bench.broke(f"{kind}: --slots {slots}", problem)
        return None


def idle(bench: Bench, group: Group) -> None:
    """Measure idle waiters' CPU, and their server's, sessions and drain, for N = 1 and 3.

    On etcd, `etcdctl lock`'s waiters too, on the same server, for reference.
    """
    waiters, window = group.effort.idle_waiters, group.effort.idle_window
    group.heading(2, f"idle waiters: {waiters} waiters (-w forever) on a held lock, {window:.0f} s")
    alone = server_alone(bench, group, window)
    for kind, slots in ((kind, slots) for kind in group.backends for slots in SLOTS):
        if (result := idle_case(bench, kind, slots, waiters, window)) is None:
            continue
        what, usage = f"{kind} --slots {slots}", result.usage
        core.idle_row(f"{what}: waiters", usage, window)
        memory = result.pss / waiters
        numbers = f"{memory:5.1f} MiB PSS per waiter"
        row(f"{what}: memory", numbers, f"<= {PSS_TARGET:g}", memory <= PSS_TARGET)
        each = f"{usage.run * 1000 / waiters:.3f} ms CPU (exact), "
        each += f"{usage.switches / waiters:.1f} wakeups; {result.processes - waiters} children"
        row(f"{what}: per waiter", each)
        if result.server is None:
            row(f"{what}: drain", f"all {waiters} ran in {result.drain:.2f} s")
            continue
        program, load = bench.servers[kind].program, result.server
        core.idle_row(f"{what}: {program}", load, window, alone)
        # MariaDB wakes each session waiting in GET_LOCK once a second to see if its client is
        # still there, and so does PostgreSQL with the client_connection_check_interval lockrun
        # sets (14+): their cost grows with the queue. What the server spends alone is not the
        # waiters' (etcd: raft's ticks, its Go runtime).
        added = load - alone if alone is not None else load
        each = f"{max(added.run, 0.0) * 1000 / waiters / window:.3f} ms CPU/s, "
        each += f"{max(added.switches, 0) / waiters / window:.2f} wakeups/s"
        row(f"{what}: {program}/waiter", each + (" above alone" if alone is not None else ""))
        server = bench.servers[kind]
        theirs, expected = result.connected - server.held_by(slots), server.sessions(waiters, slots)
        holders = f"{server.held_by(slots)} of the holder" + ("s" if slots > 1 else "")
        numbers = f"{theirs / waiters:4.2f}/waiter: {result.connected} = {theirs} + {holders}"
        row(
            f"{what}: sessions",
            f"{numbers}; {result.blocked} waiting",
            f"<= {expected}",
            theirs <= expected,
        )
        row(
            f"{what}: drain",
            f"all {waiters} ran in {result.drain:.2f} s; {result.left} sessions left",
        )
    if ETCD in group.backends:
        etcdctl_idle(bench, waiters, window, alone)


def etcdctl_idle(bench: Bench, waiters: int, window: float, alone: Usage | None) -> None:
    """Measure `etcdctl lock` waiters on the etcd group's etcd, for reference beside lockrun's.

    Each keeps its session's lease alive on a gRPC stream (every 20 s at etcdctl's 60 s TTL).
    """
    if (result := idle_case(bench, ETCDCTL_LOCK, 1, waiters, window)) is None:
        return
    usage, load = result.usage, result.server or Usage(0.0, 0.0, 0)
    numbers = f"{usage.cpu:5.3f} s CPU ({usage.run * 1000:.1f} ms exact), {usage.switches} wakeups"
    row("etcdctl lock: waiters", numbers)
    row("etcdctl lock: memory", f"{result.pss / waiters:5.1f} MiB PSS per waiter")
    added = load - alone if alone is not None else load
    each = f"{max(added.run, 0.0) * 1000 / waiters / window:.3f} ms CPU/s, "
    each += f"{max(added.switches, 0) / waiters / window:.2f} wakeups/s"
    row("etcdctl lock: etcd", f"{load.cpu:5.3f} s CPU ({load.run * 1000:.1f} ms exact)")
    row("etcdctl lock: etcd/waiter", each + (" above alone" if alone is not None else ""))


def server_alone(bench: Bench, group: Group, window: float) -> Usage | None:
    """Measure *group*'s server with no client over *window*, for reference; None: no server."""
    if (server := bench.server_of(group.backends[0])) is None:
        return None
    try:
        before = server.usage()
        time.sleep(window)
        alone = server.usage() - before
    except (OSError, ValueError, IndexError) as err:  # /proc: the server ended
        bench.broke(f"{server.program} alone", Broken(str(err)))
        return None
    numbers = f"{alone.cpu:5.3f} s CPU ({alone.run * 1000:.1f} ms exact), {alone.switches} wakeups"
    row(f"{server.program} alone, no client", numbers)
    return alone


def fifo_scenario(bench: Bench, kind: str, slots: int, hold: float) -> tuple[list[int], list[int]]:
    """Queue waiters one by one, release *hold* s after the first; return grant, append order."""
    scenario = bench.scenario_dir(f"fifo-{kind}-{slots}")
    target, order = bench.target(kind, scenario), scenario / "order"
    with Processes(scenario) as procs:
        go = bench.start_holders(procs, target, slots, core.IDLE_POLL)
        first = time.monotonic()
        for index in range(bench.plan.fifo_waiters):
            began = time.monotonic()
            script = ["sh", "-c", APPEND_SCRIPT, "sh", str(index), str(order)]
            waiter = procs.spawn(target.argv(*script, slots=slots, wait=True))
            bench.wait_queued(procs, target, [waiter])
            time.sleep(max(0.0, began + FIFO_SPACING - time.monotonic()))
        time.sleep(max(0.0, first + hold - time.monotonic()))
        go.touch()
        procs.finish(30.0)
    # The grant order is the order of the commands' LOCKRUN_FENCE (the append order without).
    lines = [line.split() for line in order.read_text().splitlines()]
    appended = [int(fields[0]) for fields in lines]
    if any(len(fields) != 2 for fields in lines):
        return appended, appended
    return [int(fields[0]) for fields in sorted(lines, key=lambda f: int(f[1]))], appended


def fifo(bench: Bench, group: Group) -> None:
    """Do waiters get the lock in the order they queued: released at once, and (full) late."""
    waiters, spacing = bench.plan.fifo_waiters, FIFO_SPACING * 1000
    group.heading(3, f"FIFO: {waiters} waiters queued {spacing:.0f} ms apart, then release")
    for hold in [0.0] if bench.plan.quick else [0.0, LONG_HOLD]:
        if hold:
            print(f"  -- released {hold:.0f} s after the first waiter queued (long waits):")
        for kind, slots in ((kind, slots) for kind in group.backends for slots in SLOTS):
            what = f"{kind}: --slots {slots}" + (f", {hold:.0f} s" if hold else "")
            try:
                granted, appended = fifo_scenario(bench, kind, slots, hold)
            except Broken as err:
                bench.broke(what, err)
                continue
            in_order = granted == list(range(waiters))
            row(what, f"granted {' '.join(map(str, granted))} (by fence)", "= arrival", in_order)
            if appended != granted:  # with N slots, N commands race to append: for reference
                row(f"{what}, append order", "ran " + " ".join(map(str, appended)))
            if not in_order:  # docs/design.md lets N slots be overtaken N-1 times
                later = (sum(x > w for x in granted[:i]) for i, w in enumerate(granted))
                most = max(later, default=0)
                row(f"{what}, overtaken", f"at most {most}x by a later waiter (N-1 = {slots - 1})")
    if bench.plan.quick:
        row(f"release after {LONG_HOLD:.0f} s", "skipped with --quick")


class Entry(NamedTuple):
    """A contender of the Python API sections, and the backend whose target it locks."""

    contender: api.Contender
    kind: str

    @property
    def label(self) -> str:
        lockrun = self.contender is api.LOCKRUN
        return f"lockrun.Lock, {self.kind}" if lockrun else self.contender.label


def api_entries(
    backends: Iterable[str], *, waiting: bool = False
) -> tuple[list[Entry], list[api.Contender]]:
    """Return lockrun on each of *backends*, and their peers once each; and those not installed.

    With *waiting*, only the contenders that can wait for a held lock.
    """
    entries, missing = [Entry(api.LOCKRUN, backend) for backend in backends], []
    for backend in backends:
        for peer in api.PEERS[backend]:
            if peer in missing or any(peer is entry.contender for entry in entries):
                continue
            if importlib.util.find_spec(peer.module) is None:
                missing.append(peer)
            elif peer.waits or not waiting:
                entries.append(Entry(peer, backend))
    return entries, missing


def api_argv(entry: Entry, target: Target, *mode: str) -> list[str]:
    """Return the command line of one process of *entry* on *target* (bench/api.py)."""
    where = [target.uri, target.name, str(target.directory)]
    return [sys.executable, "-m", "bench.api", entry.contender.name, *where, *mode]


def shuffled_rounds(entries: Sequence[Entry], rounds: int) -> Iterator[Entry]:
    """Yield every entry once per round, in a new order each round."""
    for _ in range(rounds):
        yield from random.sample(entries, len(entries))  # an order, not a secret


def api_latencies(
    bench: Bench, entries: Sequence[Entry], effort: ApiEffort
) -> dict[str, list[float]]:
    """Time each entry's cycles (µs), a process per entry and round; a broken one is left out."""
    times: dict[str, list[float]] = {entry.label: [] for entry in entries}
    cycles = ["--cycles", str(effort.warmup), str(effort.cycles)]
    for entry in shuffled_rounds(entries, effort.rounds):
        if entry.label not in times:
            continue
        scenario = bench.scenario_dir("api-latency")
        target, out = bench.target(entry.kind, scenario), scenario / "times"
        try:
            with Processes(scenario) as procs:
                procs.spawn(api_argv(entry, target, *cycles), out)
                procs.finish(API_TIMEOUT)
        except Broken as err:
            del times[entry.label]
            bench.broke(f"API {entry.label}", err)
            continue
        times[entry.label] += json.loads(out.read_text())
    return times


@dataclass(frozen=True)
class Contention:
    """What CONTENDING processes of one contender did: cycles/s of each round, and each one's."""

    rates: list[float]  # all processes together
    counts: list[int]  # by process, over all rounds

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def fairness(self) -> float:
        """The fewest cycles of one process over the most."""
        return min(self.counts) / max(*self.counts, 1)


def contention_round(bench: Bench, entry: Entry, window: float) -> list[int]:
    """Let CONTENDING processes of *entry* cycle on one name for *window* s; return their counts."""
    scenario = bench.scenario_dir("api-contention")
    target, go = bench.target(entry.kind, scenario), scenario / "GO"
    readies = [scenario / f"READY{index}" for index in range(CONTENDING)]
    counts = [scenario / f"count{index}" for index in range(CONTENDING)]
    with Processes(scenario) as procs:
        children = [
            procs.spawn(api_argv(entry, target, "--until", str(ready), str(go)), count)
            for ready, count in zip(readies, counts, strict=True)
        ]

        def settled() -> bool:
            exited = any(child.poll() is not None for child in children)
            return exited or all(ready.exists() for ready in readies)

        core.poll_until(settled, API_TIMEOUT, 0.005)
        if exited := [child for child in children if child.poll() is not None]:
            early = exited[0]
            msg = f"exit {early.returncode} before the start: {core.command_line(early)}"
            raise Broken(f"{msg} ({procs.stderr_of(early)})")
        if not all(ready.exists() for ready in readies):
            raise Broken(f"not ready after {API_TIMEOUT:.0f} s: {core.command_line(children[0])}")
        ahead = scenario / "GO.tmp"
        ahead.write_text(repr(time.monotonic() + window))
        ahead.replace(go)  # at once: no process reads half a deadline
        procs.finish(window + API_TIMEOUT)
    return [int(count.read_text()) for count in counts]


def api_contention(
    bench: Bench, entries: Sequence[Entry], effort: ApiEffort
) -> dict[str, Contention]:
    """Run each entry's contention rounds, interleaved; a broken entry is left out."""
    found = {entry.label: Contention([], [0] * CONTENDING) for entry in entries}
    for entry in shuffled_rounds(entries, effort.contend_rounds):
        if (before := found.get(entry.label)) is None:
            continue
        try:
            done = contention_round(bench, entry, effort.window)
        except Broken as err:
            del found[entry.label]
            bench.broke(f"API {entry.label}, {CONTENDING} processes", err)
            continue
        counts = [old + new for old, new in zip(before.counts, done, strict=True)]
        found[entry.label] = Contention([*before.rates, sum(done) / effort.window], counts)
    return found


def skipped(missing: Iterable[api.Contender]) -> None:
    for peer in missing:
        row(peer.label, f"skipped: no {peer.module} (pip install -e '.[bench]')")


def api_latency(bench: Bench, group: Group) -> None:
    """Time the Python API's acquire+release beside its peers', one process each."""
    effort = bench.plan.api
    rounds = f"{effort.rounds} rounds x {effort.cycles} cycles after {effort.warmup}"
    group.heading(4, f"Python API: acquire+release in 1 process, {rounds}")
    entries, missing = api_entries(group.backends)
    skipped(missing)
    times = api_latencies(bench, entries, effort)
    medians = {label: statistics.median(values) for label, values in times.items()}
    for label, values in times.items():
        p90 = core.percentile(values, 90)
        row(label, f"median {medians[label]:8.1f} µs  p90 {p90:8.1f} µs  n={len(values)}")
    for backend in group.backends:
        if (mine := medians.get(Entry(api.LOCKRUN, backend).label)) is None:
            continue
        peer, most = API_TARGETS[backend]
        for entry in entries:
            if entry.contender in api.PEERS[backend] and entry.label in medians:
                ratio = mine / medians[entry.label]
                target = most if entry.contender is peer else None
                core.ratio_row(f"{backend}: lockrun / {entry.contender.name}", ratio, target)


def api_throughput(bench: Bench, group: Group) -> None:
    """Let CONTENDING processes cycle on one name: lockrun's cycles/s and fairness, its peers'."""
    effort = bench.plan.api
    rounds = (
        f"{effort.contend_rounds} round{'s' * (effort.contend_rounds > 1)} of {effort.window:g} s"
    )
    group.heading(5, f"Python API: {CONTENDING} processes on one name, empty block, {rounds}")
    entries, missing = api_entries(group.backends, waiting=True)
    skipped(missing)
    found = api_contention(bench, entries, effort)
    for label, result in found.items():
        each = " ".join(map(str, result.counts))
        row(label, f"{result.rate:8.0f} cycles/s; min/max {result.fairness:4.2f}: {each}")
    for backend in group.backends:
        if (mine := found.get(Entry(api.LOCKRUN, backend).label)) is None:
            continue
        fair = mine.fairness
        row(
            f"{backend}: lockrun fairness",
            f"min/max {fair:4.2f}",
            f">= {FAIRNESS}",
            fair >= FAIRNESS,
        )
        for entry in entries:
            if entry.contender in api.PEERS[backend] and entry.label in found:
                ratio = mine.rate / found[entry.label].rate
                what = f"{backend}: cycles/s, lockrun / {entry.contender.name}"
                if entry.contender is RAW[backend]:
                    row(
                        what, f"{ratio:5.2f}x", f">= {THROUGHPUT_SHARE}x", ratio >= THROUGHPUT_SHARE
                    )
                else:
                    core.ratio_row(what, ratio)


SECTIONS: Final[tuple[Callable[[Bench, Group], None], ...]] = (
    startup,
    handoff,
    idle,
    fifo,
    api_latency,
    api_throughput,
    modes.standby_section,
    modes.modes_section,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every section once and print the report."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke)")
    parser.add_argument(
        "--only",
        metavar="GROUP[,GROUP…]",
        type=lambda text: set(text.split(",")),
        help=f"just these groups, of: {', '.join(GROUPS)} (a ratio needs the whole group's run)",
    )
    args = parser.parse_args(argv)
    if args.only and not args.only <= set(GROUPS):
        parser.error(f"--only: unknown group {', '.join(sorted(args.only - set(GROUPS)))}")
    quick, only = args.quick, args.only or set(GROUPS)
    began = time.monotonic()
    with Bench.running(core.QUICK if quick else core.FULL) as bench:
        print("lockrun benchmark" + (" (--quick)" if quick else ""), "=" * 100, sep="\n")
        print(f"date     {time.strftime('%Y-%m-%d %H:%M:%S %z')}")
        print(f"kernel   {platform.release()} on {platform.machine()}, {os.cpu_count()} CPUs")
        print(f"python   {platform.python_version()} ({sys.executable})")
        print(f"lockrun  {bench.version()} ({shlex.join(bench.lockrun)})")
        print(f"bytecode {core.compile_bytecode()}\nflock    {FLOCK}")
        print(f"load     {core.load_average()} (other work on the machine skews every number)")
        print("columns: what, numbers, target, verdict (no target: for reference)")
        for group in Group.all(bench):
            if group.name not in only:
                continue
            try:
                with serving(bench, group.backends[0]):
                    for run in SECTIONS:
                        section_began = time.monotonic()
                        run(bench, group)
                        took = f"{time.monotonic() - section_began:.1f} s"
                        print(f"  ({took}, load {core.load_average()})", flush=True)
            except Unavailable as err:
                last = group.letters[len(SECTIONS) - 1]
                core.section(f"({group.letters[0]}) to ({last}) {group.title}: skipped")
                row(f"{group.backends[0]} backend", f"skipped: {err}")
        runs = reach.QUICK_RUNS if quick else reach.RUNS
        try:
            if "reach" in only:
                reach.one_file(bench.scenario_dir("pyz"), runs, "zz1")
                reach.monitoring(bench.scenario_dir("monitoring"), runs, "zz2")
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            bench.broke("one file, monitoring", Broken(str(err)))
        return bench.finish(began)
