"""The four measurements, each one function for every backend: start-up, handoff, idle, FIFO.

Each section measures a group of backends: the local ones together, then each server backend
against its own throwaway server. The scenario functions are `bench.report`'s too.
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from bench.core import (
    FLOCK,
    HANDOFF_POLL,
    IDLE_POLL,
    LOCAL,
    SERVED,
    SOCKET,
    Bench,
    Broken,
    Effort,
    Processes,
    Usage,
    describe_ms,
    describe_tail,
    family_usage,
    idle_row,
    make_target,
    poll_until,
    row,
    section,
    spent,
    start_holders,
    verdict,
    wait_queued,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from bench.servers import Server

APPEND_SCRIPT: Final = 'echo "$1 ${LOCKRUN_FENCE:-}" >> "$2"'  # $1 index, $2 order file
STAMP: Final = ("date", "+%s%N")
FIFO_SPACING: Final = 0.1
LONG_HOLD: Final = 6.0  # a wait of seconds, as in real use, not only a fresh queue
STARTUP_TARGET: Final = 1.3
FILE_HANDOFF_RATIO: Final = 2.0
OTHER_HANDOFF_MS: Final = 10.0
SLOTS: Final = (1, 3)
# What lockrun's start-up is divided by: the interpreter importing click and the driver.
DRIVERS: Final = {"redis": "redis", "mysql": "pymysql", "postgres": "psycopg"}
TITLES: Final = {"redis": "Redis", "mysql": "MySQL", "postgres": "PostgreSQL"}


def imports(backends: Iterable[str]) -> str:
    """Return what `python -c 'import …'` imports for *backends*: click and their drivers."""
    return ", ".join(["click", *(DRIVERS[b] for b in backends if b in DRIVERS)])


@dataclass(frozen=True)
class Group:
    """Backends measured in the same sections: the local ones, or one server's."""

    backends: tuple[str, ...]
    effort: Effort
    title: str  # "" for the local backends
    letters: str  # of its four sections


def groups(bench: Bench) -> list[Group]:
    """Return the local backends' group, then one group per server backend."""
    found = [(LOCAL, "")] + [((backend,), TITLES[backend]) for backend in SERVED]
    return [
        Group(
            backends, bench.plan.efforts[backends[0]], title, "abcdefghijklmnop"[4 * i : 4 * i + 4]
        )
        for i, (backends, title) in enumerate(found)
    ]


def heading(group: Group, index: int, what: str) -> None:
    """Print the heading of the group's *index*-th section."""
    title = f"{group.title} {what}" if group.title else what[0].upper() + what[1:]
    section(f"({group.letters[index]}) {title}")


def server(bench: Bench, kind: str) -> Server:
    """Return the running server of *kind*."""
    found = bench.server_of(kind)
    if found is None:
        msg = f"{kind} has no server"
        raise Broken(msg)
    return found


# -- start-up ------------------------------------------------------------------------------


def time_commands(commands: dict[str, list[str]], runs: int) -> dict[str, list[float]]:
    """Run every command *runs* times, round-robin after a warm-up; return wall times in s."""
    times: dict[str, list[float]] = {label: [] for label in commands}
    for attempt in range(runs + 1):
        for label, argv in commands.items():
            began = time.perf_counter()
            subprocess.run(
                argv,
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if attempt > 0:  # the first round warms the page cache
                times[label].append(time.perf_counter() - began)
    return times


def startup(bench: Bench, group: Group) -> None:
    """Compare `lockrun … -- true` with importing click (and the driver) and with flock(1)."""
    runs = group.effort.startup_runs
    heading(group, 0, f"startup: median wall time of {runs} runs each")
    scenario = bench.scenario_dir("startup")
    modules = imports(group.backends)
    lockruns: dict[str, str] = {}
    commands: dict[str, list[str]] = {}
    for backend in group.backends:
        lock = make_target(bench, backend, scenario)
        if backend in SERVED:
            found = server(bench, backend)
            try:
                row("server", f"{found.program} {found.version()}, {found.uri}")
            except Broken as err:
                bench.broke(f"{backend} startup", err)
                return
            row("server start", f"{found.ready_in:.1f} s: a fresh data directory, then a session")
        shown = lock.uri.split(":")[0] + ("://…" if backend in SERVED else ":")
        lockruns[backend] = f"lockrun --uri {'file:DIR' if backend == 'file' else shown} -- true"
        commands[lockruns[backend]] = lock.argv(bench.lockrun, ["true"])
    for module in dict.fromkeys((modules, "click")):
        commands[f"python -c 'import {module}'"] = [sys.executable, "-c", f"import {module}"]
    commands["python -c pass"] = [sys.executable, "-c", "pass"]
    commands["flock DIR/x true"] = [FLOCK, str(scenario / "x"), "true"]
    try:
        medians = {
            label: statistics.median(v) for label, v in time_commands(commands, runs).items()
        }
    except subprocess.CalledProcessError as err:
        bench.broke("startup", Broken(f"exit {err.returncode} from {shlex.join(err.cmd)}"))
        return
    for label, median in medians.items():
        row(label, f"{median * 1000:7.1f} ms")
    for backend, label in lockruns.items():
        prefix = f"{backend}: " if len(group.backends) > 1 else ""
        for module in dict.fromkeys((modules, "click")):
            ratio = medians[label] / medians[f"python -c 'import {module}'"]
            ok = verdict(ratio <= STARTUP_TARGET) if module == modules else ""  # else reference
            target = f"<= {STARTUP_TARGET}x" if ok else ""
            row(f"{prefix}lockrun / import {module}", f"{ratio:5.2f}x", target, ok)
        row(f"{prefix}lockrun / flock(1)", f"{medians[label] / medians['flock DIR/x true']:5.1f}x")


# -- handoff -------------------------------------------------------------------------------


def handoff_trial(bench: Bench, kind: str) -> float:
    """Return one handoff latency in ms: holder's command exits -> waiter's command starts."""
    scenario = bench.scenario_dir(f"handoff-{kind}")
    target = make_target(bench, kind, scenario)
    end, start = scenario / "END", scenario / "START"
    with Processes(scenario) as procs:
        go = start_holders(bench, procs, target, 1, HANDOFF_POLL, stdout=end)
        waiter = procs.spawn(target.argv(bench.lockrun, STAMP, wait=True), stdout=start)
        wait_queued(bench, procs, target, [waiter])
        go.touch()
        procs.finish(10.0)
    return (int(start.read_text()) - int(end.read_text())) / 1e6


def handoff_trials(
    bench: Bench, labels: dict[str, str], trials: int
) -> tuple[dict[str, list[float]], set[str]]:
    """Run *trials* handoffs of every kind in *labels*, interleaved; return ms and the broken."""
    results: dict[str, list[float]] = {kind: [] for kind in labels}
    broken: set[str] = set()
    for _ in range(trials):
        for kind, values in results.items():
            if kind in broken:
                continue
            try:
                values.append(handoff_trial(bench, kind))
            except Broken as err:
                broken.add(kind)
                bench.broke(f"handoff {labels[kind]}", err)
    return results, broken


def handoff_labels(bench: Bench, group: Group) -> dict[str, str | None]:
    """Return the row label of each kind the group's handoffs time; None where --quick skips."""
    labels: dict[str, str | None] = {}
    for backend in group.backends:
        if backend in SERVED:
            labels[backend] = f"lockrun, {backend} backend (TCP)"
            labels[backend + SOCKET] = (
                f"lockrun, {backend} backend (socket)" if bench.plan.socket else None
            )
        else:
            labels[backend] = f"lockrun, {backend} backend"
    return labels | {"flock": "flock(1) on a file"}


def handoff(bench: Bench, group: Group) -> None:
    """Time handoffs of each backend (and a server's socket) against flock(1), interleaved."""
    trials = group.effort.handoff_trials
    heading(
        group, 1, f"handoff: holder's command exits -> waiter's command starts, {trials} trials"
    )
    labels = handoff_labels(bench, group)
    measured = {kind: label for kind, label in labels.items() if label is not None}
    results, broken = handoff_trials(bench, measured, trials)
    for kind, label in labels.items():
        if label is None:
            row(f"{kind.removesuffix(SOCKET)} backend (socket)", "skipped with --quick")
        elif kind not in broken:
            values = results[kind]
            row(label, describe_ms(values) if kind == "flock" else describe_tail(values))
            if kind in group.backends:
                slowest = "  ".join(f"{value:.2f}" for value in sorted(values, reverse=True)[:3])
                row(f"{kind}: slowest three", f"{slowest} ms")
    if "flock" in broken:
        return
    flock_median = statistics.median(results["flock"])
    for backend in (backend for backend in group.backends if backend not in broken):
        median = statistics.median(results[backend])
        ratio = median / flock_median
        if backend == "file":  # both flock(2): lockrun's own cost, over flock(1)'s
            ok = ratio <= FILE_HANDOFF_RATIO
            row(
                "file: lockrun / flock(1), median",
                f"{ratio:5.2f}x",
                f"<= {FILE_HANDOFF_RATIO}x",
                verdict(ok),
            )
        else:
            row(f"{backend}: lockrun / flock(1)", f"{ratio:5.2f}x")
            ok = median <= OTHER_HANDOFF_MS
            row(
                f"{backend}: median",
                f"{median:6.2f} ms",
                f"<= {OTHER_HANDOFF_MS:.0f} ms",
                verdict(ok),
            )


# -- idle waiters --------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerLoad:
    """What the lock server spent over the idle window, and the connections it counted."""

    usage: Usage
    connected: int  # its clients at the window's end, without the probe
    blocked: int  # of which blocked (in BLPOP, inside GET_LOCK or pg_advisory_lock)


@dataclass(frozen=True)
class IdleResult:
    """What the idle waiters cost during the window, and how long they took to drain."""

    usage: Usage
    processes: int  # the waiters and their children
    drain: float
    server: ServerLoad | None = None
    left: int = 0  # the server's connections once every waiter had run and exited


def idle_scenario(bench: Bench, kind: str, slots: int, waiters: int, window: float) -> IdleResult:
    """Hold *slots* slots, queue the waiters, measure their CPU over the window, drain.

    With a server's target, the server's CPU over the same window and its clients too.
    """
    scenario = bench.scenario_dir(f"idle-{kind}-{slots}")
    target = make_target(bench, kind, scenario)
    lock_server = bench.server_of(kind)
    with Processes(scenario) as procs:
        go = start_holders(bench, procs, target, slots, IDLE_POLL)
        queue = [
            procs.spawn(target.argv(bench.lockrun, ["true"], slots=slots, wait=True))
            for _ in range(waiters)
        ]
        wait_queued(bench, procs, target, queue, timeout=60.0)
        time.sleep(0.3)  # let the last starters finish whatever they do after queueing
        pids = [proc.pid for proc in queue]
        before = family_usage(pids)
        server_start = None if lock_server is None else lock_server.usage()
        time.sleep(window)
        after = family_usage(pids)
        load = None
        if lock_server is not None and server_start is not None:
            load = ServerLoad(lock_server.usage() - server_start, *lock_server.clients())
        go.touch()
        began = time.monotonic()
        procs.finish(60.0)
        drain = time.monotonic() - began
    result = IdleResult(spent(before, after), len(after), drain, load)
    if lock_server is None:
        return result
    poll_until(lambda: lock_server.clients()[0] == 0, 2.0, 0.01)  # a close arrives a bit later
    return replace(result, left=lock_server.clients()[0])


def idle_case(
    bench: Bench, kind: str, slots: int, waiters: int, window: float
) -> IdleResult | None:
    """Run one idle scenario; on trouble record the problem and return None."""
    try:
        return idle_scenario(bench, kind, slots, waiters, window)
    except (Broken, FileNotFoundError, ProcessLookupError) as err:
        problem = err if isinstance(err, Broken) else Broken(f"waiter vanished: {err}")
        bench.broke(f"{kind}: --slots {slots}", problem)
        return None


def idle(bench: Bench, group: Group) -> None:
    """Measure idle waiters' CPU, and their server's, sessions and drain, for N = 1 and 3."""
    waiters, window = group.effort.idle_waiters, group.effort.idle_window
    heading(
        group, 2, f"idle waiters: {waiters} waiters (-w forever) on a held lock, {window:.0f} s"
    )
    for kind in group.backends:
        for slots in SLOTS:
            result = idle_case(bench, kind, slots, waiters, window)
            if result is None:
                continue
            what = f"{kind} --slots {slots}"
            idle_row(f"{what}: waiters", result.usage, window)
            children = result.processes - waiters
            each = f"{result.usage.run * 1000 / waiters:.3f} ms CPU (exact), "
            row(
                f"{what}: per waiter",
                f"{each}{result.usage.switches / waiters:.1f} wakeups; {children} children",
            )
            load = result.server
            if load is None:
                row(f"{what}: drain", f"all {waiters} ran in {result.drain:.2f} s")
                continue
            program = server(bench, kind).program
            idle_row(f"{what}: {program}", load.usage, window)
            # MariaDB wakes each session waiting in GET_LOCK once a second to see if its client
            # is still there, and so does PostgreSQL with the client_connection_check_interval
            # lockrun sets (14+): their cost grows with the queue.
            each = f"{load.usage.run * 1000 / waiters / window:.3f} ms CPU/s, "
            row(
                f"{what}: {program}/waiter",
                f"{each}{load.usage.switches / waiters / window:.2f} wakeups/s",
            )
            # One session per waiter, and N - 1 more for the head, which waits on every slot.
            theirs, expected = load.connected - slots, waiters + slots - 1
            holders = "1 holder" if slots == 1 else f"{slots} holders"
            numbers = f"{theirs / waiters:4.2f}/waiter: {load.connected} = {theirs} + {holders}"
            numbers += f"; {load.blocked} waiting"
            row(f"{what}: sessions", numbers, f"<= {expected}", verdict(theirs <= expected))
            drained = f"all {waiters} ran in {result.drain:.2f} s; {result.left} sessions left"
            row(f"{what}: drain", drained)


# -- FIFO ----------------------------------------------------------------------------------


def fifo_scenario(bench: Bench, kind: str, slots: int, hold: float) -> tuple[list[int], list[int]]:
    """Queue waiters one by one, release *hold* s after the first; return grant, append order.

    The grant order is the order of the commands' LOCKRUN_FENCE (the append order without it).
    """
    scenario = bench.scenario_dir(f"fifo-{kind}-{slots}")
    target = make_target(bench, kind, scenario)
    order = scenario / "order"
    with Processes(scenario) as procs:
        go = start_holders(bench, procs, target, slots, IDLE_POLL)
        first = time.monotonic()
        for index in range(bench.plan.fifo_waiters):
            began = time.monotonic()
            command = ["sh", "-c", APPEND_SCRIPT, "sh", str(index), str(order)]
            waiter = procs.spawn(target.argv(bench.lockrun, command, slots=slots, wait=True))
            wait_queued(bench, procs, target, [waiter])
            time.sleep(max(0.0, began + FIFO_SPACING - time.monotonic()))
        time.sleep(max(0.0, first + hold - time.monotonic()))
        go.touch()
        procs.finish(30.0)
    lines = [line.split() for line in order.read_text().splitlines()]
    appended = [int(fields[0]) for fields in lines]
    if all(len(fields) == 2 for fields in lines):
        granted = [int(fields[0]) for fields in sorted(lines, key=lambda fields: int(fields[1]))]
    else:
        granted = appended
    return granted, appended


def fifo(bench: Bench, group: Group) -> None:
    """Do waiters get the lock in the order they queued: released at once, and (full) late."""
    waiters = bench.plan.fifo_waiters
    heading(
        group, 3, f"FIFO: {waiters} waiters queued {FIFO_SPACING * 1000:.0f} ms apart, then release"
    )
    for hold in [0.0, LONG_HOLD] if bench.plan.long_fifo else [0.0]:
        if hold:
            print(f"  -- released {hold:.0f} s after the first waiter queued (long waits):")
        for kind in group.backends:
            for slots in SLOTS:
                fifo_case(bench, kind, slots, hold)
    if not bench.plan.long_fifo:
        row(f"release after {LONG_HOLD:.0f} s", "skipped with --quick")


def fifo_case(bench: Bench, kind: str, slots: int, hold: float) -> None:
    """Run and report one FIFO scenario."""
    what = f"{kind}: --slots {slots}" + (f", {hold:.0f} s" if hold else "")
    arrival = list(range(bench.plan.fifo_waiters))
    try:
        granted, appended = fifo_scenario(bench, kind, slots, hold)
    except Broken as err:
        bench.broke(what, err)
        return
    numbers = "granted " + " ".join(map(str, granted)) + " (by fence)"
    row(what, numbers, "= arrival", verdict(granted == arrival))
    if appended != granted:  # with N slots, N commands race to append: for reference
        row(f"{what}, append order", "ran " + " ".join(map(str, appended)))
    if granted != arrival:  # docs/design.md lets N slots be overtaken N-1 times
        row(
            f"{what}, overtaken",
            f"at most {overtaken(granted)}x by a later waiter (N-1 = {slots - 1})",
        )


def overtaken(granted: Sequence[int]) -> int:
    """Return how often the most overtaken waiter saw a later arrival granted before it."""
    return max(
        (sum(later > waiter for later in granted[:place]) for place, waiter in enumerate(granted)),
        default=0,
    )


SECTIONS: Final = (startup, handoff, idle, fifo)
