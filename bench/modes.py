"""The fleet modes in the bench: hot-standby fail-over times, and what each mode costs.

Two sections of ``python -m bench`` per backend group (bench/measure.py), and two tables of
``python -m bench.report``:

- **Hot standby fail-over** (docs/semantics.md "One active daemon, hot standbys"): two
  ``lockrun --wait forever --ttl 3 --kill-after 1 -- daemon``, the second queued behind the
  first; the time from the active daemon's end (a clean stop: TERM to its lockrun; a crash:
  SIGKILL of lockrun and the daemon's process group) or from the cut (a server backend: the
  active one's link to the server, a `Proxy`, goes silent) to the standby's daemon starting.
  The cut-off daemon must have ended before the standby's starts: an overlap is a problem.
- **Cost of each mode**: an uncontended ``lockrun -- true`` plain, ``--shared``,
  ``--hold-at-least`` (a window still open at release: what its marker costs) and
  ``--take-over --wait 5`` on a free lock, interleaved, each run on a fresh name; and the
  take-over latency: from a taker's start to its command's start while a holder runs (the
  notice, the holder's stop, the hand-over).

A mode a backend does not implement is an ``unsupported`` row (it did nothing: a second
reader found the lock busy, the lock was free inside the window, the holder never heard the
taker), not a problem; a crash, a hang or an unexpected status is one (`Broken`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import select
import shlex
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from bench import core
from bench.core import Broken, Processes, row
from lockrun.uri import SCHEMES
from tests.support.proxy import Proxy

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from pathlib import Path
    from subprocess import Popen

    from bench.core import Bench, Target
    from bench.measure import Group

TTL: Final = 3.0  # as the chaos tests' LEASE: a fail-over that waits out a lease is seconds
KILL_AFTER: Final = 1.0
LEASE: Final = ("--ttl", f"{TTL:g}", "--kill-after", f"{KILL_AFTER:g}")
TRIALS: Final = 5  # of each fault, and of take-overs
QUICK_TRIALS: Final = 2
PATIENCE: Final = 30.0  # seconds a step may take before the trial counts as broken
CLEAN, CRASH, CUT = "clean stop", "crash", "host cut off"
# What the docs promise (docs/semantics.md "One active daemon, hot standbys"): a clean stop
# is a hand-over ("within milliseconds"), and so is a crash where the lock dies with its
# holder; a lease outlives its holder by at most a ttl; a cut-off holder's slot goes once
# the service lets it go, "at most --ttl plus the server's checks".
HANDOVER_MS: Final = 10.0  # a median, as the handoff target of bench/measure.py
# A median too: the death must be noticed first (abstract: a hang-up, then a 5 ms pause
# before binding the freed name, backends/abstract.py TRANSITION).
CRASH_MS: Final = 50.0
CHECKS: Final = 1.0  # the servers' idle checks, on top of a ttl
# A daemon: notes "PID NS" in START; on TERM notes NS in END and exits; it ends by itself once
# the bench's directory is gone. $1 START, $2 END, $3 directory.
DAEMON: Final = (
    'echo "$$ $(date +%s%N)" > "$1.tmp"; mv "$1.tmp" "$1"; '
    'trap \'date +%s%N > "$2.tmp"; mv "$2.tmp" "$2"; exit 0\' TERM; '
    'while [ -d "$3" ]; do sleep 0.005; done'
)
# A reader for the --shared probe: says it runs, then holds while the directory is there.
READER: Final = ': > "$1"; while [ -d "$2" ]; do sleep 0.01; done'
WINDOW: Final = "1m"  # --hold-at-least: still open at release, whatever the machine's load
TAKER_WAIT: Final = 5.0
MODES: Final = {
    "plain": (),
    "--shared": ("--shared",),
    f"--hold-at-least {WINDOW}": ("--hold-at-least", WINDOW),
    f"--take-over --wait {TAKER_WAIT:g}": ("--take-over", "--wait", f"{TAKER_WAIT:g}"),
}
PLAIN, SHARED, HOLD, _ = MODES
TAKE_OVER: Final = "take-over"  # the take-overs' key in `ModeCosts.unsupported`, `.broken`


class Unsupported(Exception):
    """The backend did not do what the mode asks; the message says what happened instead."""


def trials(bench: Bench) -> int:
    """Return how many trials of each fault, and of take-overs, this run makes."""
    return QUICK_TRIALS if bench.plan.quick else TRIALS


# -- hot standby fail-over ----------------------------------------------------------------------


@dataclass
class Failovers:
    """One fault's fail-over times on one backend, in ms; `broke` says why they stopped."""

    times: list[float] = field(default_factory=list)  # the standby's start, after the fault
    stopped: list[float] = field(default_factory=list)  # a cut: the cut-off daemon's end
    broke: str = ""


def faults(bench: Bench, kind: str) -> tuple[str, ...]:
    """Return the faults *kind* is tried with: a cut needs a server."""
    return (CLEAN, CRASH, CUT) if bench.server_of(kind) is not None else (CLEAN, CRASH)


def standby(bench: Bench, kind: str, count: int) -> dict[str, Failovers]:
    """Time *count* fail-overs of each fault on *kind*, interleaved; a broken fault stops."""
    found = {fault: Failovers() for fault in faults(bench, kind)}
    for fault in (fault for _ in range(count) for fault in found):
        if found[fault].broke:
            continue
        try:
            took, stopped = standby_trial(bench, kind, fault)
        except Broken as err:
            found[fault].broke = str(err)
            bench.broke(f"{kind}: standby, {fault}", err)
            continue
        found[fault].times.append(took)
        if stopped is not None:
            found[fault].stopped.append(stopped)
    return found


def stamp(path: Path) -> int:
    """Return the Unix time in ns a daemon noted in *path* (its last field)."""
    return int(path.read_text().split()[-1])


def start_daemon(procs: Processes, target: Target, label: str) -> tuple[Popen[bytes], Path, Path]:
    """Start ``lockrun -w forever --ttl 3 --kill-after 1 -- daemon``; return it, START, END."""
    start, end = procs.directory / f"{label}.start", procs.directory / f"{label}.end"
    daemon = ["sh", "-c", DAEMON, "sh", str(start), str(end), str(procs.directory)]
    return procs.spawn(target.argv(*daemon, wait=True, options=LEASE)), start, end


def started(process: Popen[bytes], start: Path, timeout: float) -> None:
    """Wait until *process*'s daemon noted its start; `Broken` if it exits or takes too long."""
    core.poll_until(lambda: start.exists() or process.poll() is not None, timeout, 0.002)
    if not start.exists():
        status = process.poll()
        what = "still waiting" if status is None else f"exit {status}"
        raise Broken(f"{what} after {timeout:.0f}s: {core.command_line(process)}") from None


def standby_trial(bench: Bench, kind: str, fault: str) -> tuple[float, float | None]:
    """Run one fail-over of *fault* on *kind*; return ms to the standby's start, and to a stop.

    The second number, for a cut only: ms from the cut to the cut-off daemon's end.
    """
    directory = bench.scenario_dir(f"standby-{kind}")
    target = bench.target(kind, directory)
    server = bench.server_of(kind)
    # The active host's own link to the server, to cut (a server's TCP port, behind a proxy).
    proxy = None if fault != CUT or server is None else Proxy(("127.0.0.1", server.server.port))
    try:
        with Processes(directory) as procs:
            active_target = target
            if proxy is not None:
                proxied = through(target.uri, proxy.target[1], proxy.port)
                active_target = dataclasses.replace(target, uri=proxied)
            active, active_start, active_end = start_daemon(procs, active_target, "active")
            started(active, active_start, PATIENCE)
            waiting, standby_start, _ = start_daemon(procs, target, "standby")
            bench.wait_queued(procs, target, [waiting], timeout=PATIENCE)
            if proxy is not None:
                return cut_off(procs, proxy, (active, active_end), (waiting, standby_start))
            if fault == CLEAN:
                active.send_signal(signal.SIGTERM)
                started(waiting, standby_start, PATIENCE)
                expect(procs, active, 0)  # the daemon's own status: its trap exits 0
                return (stamp(standby_start) - stamp(active_end)) / 1e6, None
            ended = crash(active, int(active_start.read_text().split()[0]))
            started(waiting, standby_start, TTL + PATIENCE)
            return (stamp(standby_start) - ended) / 1e6, None
    finally:
        if proxy is not None:  # after the processes, which leave through it
            proxy.close()


def through(uri: str, port: int, proxy: int) -> str:
    """Return *uri* with its server's *port* replaced by the *proxy*'s; `Broken` if it has none.

    The port ends the address: a path (``redis://H:P/0``), a query, the next member
    (``etcd://H:P,H2:P2``) or the URI itself (``etcd://H:P``) follows it.
    """
    proxied, found = re.subn(rf":{port}(?=[/?,]|$)", f":{proxy}", uri, count=1)
    if not found:
        raise Broken(f"no port {port} in {uri} to send through the proxy")
    return proxied


def cut_off(
    procs: Processes,
    proxy: Proxy,
    active: tuple[Popen[bytes], Path],
    standby: tuple[Popen[bytes], Path],
) -> tuple[float, float]:
    """Silence the active's link; return ms from the cut to the standby's start, to its end.

    The cut-off daemon must have ended first (else `Broken`: an overlap), and its lockrun
    exit 76.
    """
    (holder, end), (waiting, start) = active, standby
    # Somewhere in the lease's renewal cycle, as a real cut is.
    time.sleep(random.uniform(0, TTL / 3))  # noqa: S311 - a moment, not a secret
    proxy.blackhole()
    cut = time.time_ns()
    started(waiting, start, TTL + PATIENCE)
    if not end.exists() or stamp(end) > stamp(start):
        msg = f"the cut-off daemon still ran when the standby's started: {procs.directory}"
        raise Broken(f"OVERLAP: {msg}")
    expect(procs, holder, 76)
    return (stamp(start) - cut) / 1e6, (stamp(end) - cut) / 1e6


def crash(active: Popen[bytes], daemon: int) -> float:
    """SIGKILL lockrun *active* and its *daemon*'s process group; return when the daemon died.

    Unix time in ns, seen through a pidfd: the moment the kernel reaped it, late only by our
    own scheduling.
    """
    pidfd = os.pidfd_open(daemon)
    try:
        group = os.getpgid(daemon)
        if group == os.getpgid(0):
            raise Broken(f"the daemon {daemon} runs in the bench's own process group")
        active.kill()
        with contextlib.suppress(ProcessLookupError):  # its guardian may have been first
            os.killpg(group, signal.SIGKILL)
        ready, _, _ = select.select([pidfd], [], [], PATIENCE)
        if not ready:
            raise Broken(f"the daemon {daemon} outlived SIGKILL by {PATIENCE:.0f}s")
        return time.time_ns()
    finally:
        os.close(pidfd)


def expect(procs: Processes, process: Popen[bytes], status: int) -> None:
    """Wait for *process* to exit with *status*; `Broken` if it does otherwise."""
    try:
        found = process.wait(PATIENCE)
    except subprocess.TimeoutExpired:
        raise Broken(f"still running after {PATIENCE:.0f}s: {core.command_line(process)}") from None
    if found != status:
        msg = f"exit {found}, not {status}, from {core.command_line(process)}"
        raise Broken(f"{msg}: {procs.stderr_of(process)}")


def standby_section(bench: Bench, group: Group) -> None:
    """Print each backend's fail-over times, judged against what the docs promise."""
    count = trials(bench)
    what = f"hot standby fail-over: the daemon's end (or the cut) -> the standby's, {count} trials"
    group.heading(6, f"{what}, --ttl {TTL:g}")
    for kind in group.backends:
        scheme = SCHEMES[kind]
        for fault, found in standby(bench, kind, count).items():
            if not found.times:
                continue  # broke, and said so
            numbers, median, most = core.describe(found.times, tail=False), *spread(found.times)
            if fault == CUT:
                limit = (TTL + CHECKS) * 1000
                row(f"{kind}: {fault}", numbers, f"<= {limit / 1000:g} s max", most <= limit)
                stops = core.describe(found.stopped, tail=False)
                row(f"{kind}: cut-off daemon stopped", f"{stops} after the cut")
            elif fault == CRASH and scheme.leased:
                row(f"{kind}: {fault}", numbers, f"<= {TTL:g} s max", most <= TTL * 1000)
            elif fault == CRASH:
                row(f"{kind}: {fault}", numbers, f"<= {CRASH_MS:g} ms", median <= CRASH_MS)
            else:
                row(f"{kind}: {fault}", numbers, f"<= {HANDOVER_MS:g} ms", median <= HANDOVER_MS)


def spread(values: Sequence[float]) -> tuple[float, float]:
    """Return the median and the max of *values*."""
    return statistics.median(values), max(values)


# -- the cost of each mode ----------------------------------------------------------------------


@dataclass
class ModeCosts:
    """What the modes cost on one backend, and which were unsupported or broke."""

    medians: dict[str, float] = field(default_factory=dict)  # seconds, by MODES label
    unsupported: dict[str, str] = field(default_factory=dict)  # by label or TAKE_OVER: why
    broken: set[str] = field(default_factory=set)  # by label or TAKE_OVER (a bench problem)
    takeover: list[float] = field(default_factory=list)  # ms: taker's start -> its command's
    notice: list[float] = field(default_factory=list)  # ms: taker's start -> holder's TERM

    def failed(self, label: str) -> bool:
        return label in self.unsupported or label in self.broken

    def ratio(self, label: str) -> float | None:
        """Return *label*'s median over the plain run's, None if either is missing."""
        plain, mine = self.medians.get(PLAIN), self.medians.get(label)
        return None if plain is None or mine is None or self.failed(label) else mine / plain


def mode_costs(bench: Bench, kind: str, runs: int, count: int) -> ModeCosts:
    """Time *runs* uncontended cycles of each mode, interleaved, then *count* take-overs."""
    costs = ModeCosts()
    scenario = bench.scenario_dir(f"modes-{kind}")
    target = bench.target(kind, scenario)
    times: dict[str, list[float]] = {label: [] for label in MODES}
    last: dict[str, Target] = {}
    for attempt in range(runs + 1):  # the first round warms the page cache
        for index, (label, options) in enumerate(MODES.items()):
            if costs.failed(label):
                continue
            fresh = dataclasses.replace(target, name=f"{target.name}-{index}-{attempt}")
            with failing(bench, costs, kind, label):
                took = cycle(fresh, options)
                last[label] = fresh
                if attempt > 0:
                    times[label].append(took)
    costs.medians = {label: statistics.median(found) for label, found in times.items() if found}
    for label, probe in ((SHARED, probe_shared), (HOLD, probe_window)):
        if not costs.failed(label) and label in last:
            with failing(bench, costs, kind, label):
                probe(bench, last[label])
    for _ in range(count if not costs.failed(TAKE_OVER) else 0):
        with failing(bench, costs, kind, TAKE_OVER):
            took, notice = takeover_trial(bench, kind)
            costs.takeover.append(took)
            costs.notice.append(notice)
        if costs.failed(TAKE_OVER):
            break
    return costs


@contextlib.contextmanager
def failing(bench: Bench, costs: ModeCosts, kind: str, label: str) -> Iterator[None]:
    """Note an `Unsupported` or `Broken` *label* in *costs* (the latter a bench problem)."""
    try:
        yield
    except Unsupported as err:
        costs.unsupported[label] = str(err)
    except Broken as err:
        costs.broken.add(label)
        bench.broke(f"{kind}: {label}", err)


def lockrun_once(target: Target, options: Sequence[str]) -> tuple[int, float, str]:
    """Run ``lockrun [OPTIONS] -- true`` on *target*; return its status, wall time, stderr."""
    argv = target.argv("true", options=options)
    began = time.perf_counter()
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PATIENCE, check=False
        )
    except subprocess.TimeoutExpired:
        raise Broken(f"still running after {PATIENCE:.0f}s: {shlex.join(argv)}") from None
    took = time.perf_counter() - began
    err = " | ".join(done.stderr.decode(errors="replace").strip().splitlines())
    return done.returncode, took, f"{shlex.join(argv)}: {err}" if err else shlex.join(argv)


def cycle(target: Target, options: Sequence[str]) -> float:
    """Run ``lockrun [OPTIONS] -- true`` on *target* once; return its wall time in s.

    `Unsupported` for a usage or configuration error (64, 78): the backend refused the mode.
    """
    status, took, said = lockrun_once(target, options)
    if status in {64, 78}:
        raise Unsupported(f"exit {status} from {said}")
    if status != 0:
        raise Broken(f"exit {status} from {said}")
    return took


def probe_shared(bench: Bench, target: Target) -> None:
    """Check that a second reader gets in beside a first (one-shot); else `Unsupported`."""
    directory = bench.scenario_dir("shared-probe")
    ready = directory / "READY"
    reader = ["sh", "-c", READER, "sh", str(ready), str(directory)]
    with Processes(directory) as procs:
        first = procs.spawn(target.argv(*reader, options=("--shared",)))
        started(first, ready, PATIENCE)
        status, _, said = lockrun_once(target, ("--shared", "--wait", "0"))
    if status == 75:
        msg = "a second --shared reader found the lock busy (75)"
        raise Unsupported(msg)
    if status != 0:
        raise Broken(f"exit {status} from {said}")


def probe_window(bench: Bench, target: Target) -> None:  # noqa: ARG001 - as probe_shared
    """Check that the last --hold-at-least run's window on *target* makes a try busy (75)."""
    status, _, said = lockrun_once(target, ("--wait", "0"))
    if status == 0:
        raise Unsupported(f"the lock was free once the command had ended, inside its {WINDOW}")
    if status != 75:
        raise Broken(f"exit {status} from {said}")


# A holder that notes when it got TERM: $1 READY, $2 TERMED, $3 directory.
HOLDER: Final = (
    'trap \'date +%s%N > "$2.tmp"; mv "$2.tmp" "$2"; exit 0\' TERM; '
    ': > "$1"; while [ -d "$3" ]; do sleep 0.005; done'
)


def takeover_trial(bench: Bench, kind: str) -> tuple[float, float]:
    """Take over from a running holder; return ms to the taker's command, to the holder's TERM."""
    directory = bench.scenario_dir(f"takeover-{kind}")
    target = bench.target(kind, directory)
    ready, termed, start = (directory / name for name in ("READY", "TERMED", "START"))
    holder_argv = ["sh", "-c", HOLDER, "sh", str(ready), str(termed), str(directory)]
    taker_options = (*LEASE, "--take-over", "--wait", f"{TAKER_WAIT:g}")
    with Processes(directory) as procs:
        holder = procs.spawn(target.argv(*holder_argv, options=LEASE))
        started(holder, ready, PATIENCE)
        began = time.time_ns()
        taker = procs.spawn(target.argv("date", "+%s%N", options=taker_options), stdout=start)
        try:
            status = taker.wait(TAKER_WAIT + PATIENCE)
        except subprocess.TimeoutExpired:
            raise Broken(f"still running: {core.command_line(taker)}") from None
        if status == 75 and holder.poll() is None:
            msg = f"the holder ran on; the taker gave up after {TAKER_WAIT:g} s (75)"
            raise Unsupported(msg)
        if status == 64:  # a mode the backend declines (uri.Scheme.modes)
            raise Unsupported(f"exit 64 from {core.command_line(taker)}: {procs.stderr_of(taker)}")
        if status != 0:
            raise Broken(f"exit {status} from {core.command_line(taker)}: {procs.stderr_of(taker)}")
        expect(procs, holder, 79)
        return (stamp(start) - began) / 1e6, (stamp(termed) - began) / 1e6


def modes_section(bench: Bench, group: Group) -> None:
    """Print each backend's cost of each mode, as ratios to plain, and its take-over latency."""
    runs, count = group.effort.startup_runs, trials(bench)
    what = f"cost of each mode: uncontended `-- true`, median of {runs} runs each, interleaved"
    group.heading(7, f"{what}; take-over, {count} trials")
    for kind in group.backends:
        costs = mode_costs(bench, kind, runs, count)
        for label in [*MODES, TAKE_OVER]:
            if label in costs.unsupported:
                row(f"{kind}: {label}", "unsupported", "", "UNSUPPORTED")
                print(f"    {costs.unsupported[label]}")
            elif label == PLAIN and PLAIN in costs.medians:
                row(f"{kind}: {label}", f"{costs.medians[PLAIN] * 1000:7.1f} ms")
            elif (ratio := costs.ratio(label)) is not None:
                median = costs.medians[label] * 1000
                row(f"{kind}: {label}", f"{ratio:5.2f}x plain ({median:.1f} ms)")
        if costs.takeover:
            row(f"{kind}: take-over, taker's command", core.describe(costs.takeover, tail=False))
            row(f"{kind}: take-over, holder's TERM", core.describe(costs.notice, tail=False))
