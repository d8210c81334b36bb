"""Write lockrun's benchmark report: one Markdown table per backend beside flock(1), and a plot.

``python -m bench.report [--quick] [--out DIR] [--backends file,abstract,…]``, from the
repository root, measures each backend beside flock(1) (and a server backend beside
`etcdctl lock`), the Python API beside its peer, and writes ``benchmarks.md`` and
``handoff-latency.png`` into DIR (``docs/``). It exits 1 when something broke, 2 without matplotlib.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import shlex
import shutil
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from bench import api, core, modes
from bench.core import ETCDCTL_LOCK, SERVED, Bench, Broken, Effort, Processes
from bench.measure import (
    API_TARGETS,
    CONTENDING,
    Entry,
    api_contention,
    api_latencies,
    floor,
    handoff_trials,
    idle_case,
    start_etcd,
    startup_medians,
)
from bench.servers import Unavailable, serving
from lockrun.uri import BACKENDS

if TYPE_CHECKING:
    from collections.abc import Sequence

WAITERS: Final = 8  # idle waiters queued on a held lock
CONTENDERS: Final = 8  # processes looping acquire, run `true`, release
# One contender: run the command until STOP exists, then print how many runs completed.
CYCLE_SCRIPT: Final = (
    'stop=$1; shift; n=0; while [ ! -e "$stop" ]; do "$@" || exit; n=$((n + 1)); done; echo "$n"'
)
PLOT_NAME: Final = "handoff-latency.png"
REPORT_NAME: Final = "benchmarks.md"
DOCS: Final = Path(__file__).resolve().parent.parent / "docs"
# docs/deployment.md links to benchmarks.md#hot-standby-fail-over: keep the heading.
STANDBY_HEADING: Final = "Hot standby fail-over"
MODES_HEADING: Final = "Cost of each mode"
# The contenders loop for as long as the idle waiters wait: idle_window is theirs too.
FULL_EFFORT: Final = Effort(startup_runs=30, handoff_trials=100, idle_waiters=8, idle_window=10)
QUICK_EFFORT: Final = Effort(startup_runs=5, handoff_trials=8, idle_waiters=8, idle_window=0.5)


@dataclass
class Column:
    """One tool's numbers in a backend's table; None where the measurement broke."""

    startup: float | None = None  # median seconds
    startup_ratio: float | None = None  # over the backend's floor (bench/measure.py)
    handoff: list[float] = field(default_factory=list)  # milliseconds
    idle: float | None = None  # CPU seconds per waiter per second
    server: float | None = None  # the lock server's CPU seconds per waiter per second
    cycles: float | None = None  # per second, all contenders together


@dataclass
class ApiColumn:
    """lockrun.Lock's or its peer's numbers in the Python API table; None where it broke."""

    median: float | None = None  # µs, acquire+release in one process
    rate: float | None = None  # cycles per s, CONTENDING processes together
    fairness: float | None = None  # the fewest cycles of one process over the most
    waits: bool = True  # False: it cannot wait for a held lock, so it has no rate nor fairness


@dataclass
class Table:
    """What one backend's section says: lockrun's numbers, flock(1)'s, or why it was skipped."""

    backend: str
    lockrun: Column = field(default_factory=Column)
    flock: Column = field(default_factory=Column)
    etcd: Column | None = None  # `etcdctl lock`'s, beside a server backend
    api: tuple[ApiColumn, ApiColumn] | None = None  # lockrun.Lock's, its peer's
    standby: dict[str, modes.Failovers] | None = None  # by fault (bench/modes.py)
    modes: modes.ModeCosts | None = None
    peer: str = ""  # the peer's label
    server: str = ""  # the server's name and version
    skipped: str = ""

    def column(self, kind: str) -> Column:
        if kind == ETCDCTL_LOCK and self.etcd is not None:
            return self.etcd
        return self.flock if kind == "flock" else self.lockrun

    @property
    def kinds(self) -> list[str]:
        """The tools of the CLI columns: lockrun's backend, flock(1), maybe `etcdctl lock`."""
        return [self.backend, "flock", *([ETCDCTL_LOCK] if self.etcd else [])]


def measure(bench: Bench, backend: str, effort: Effort) -> Table:
    """Measure *backend* and flock(1) side by side, with the backend's server if it needs one.

    A server backend is measured beside `etcdctl lock` too, on a throwaway etcd that runs
    throughout (idle, it costs a few ms of CPU per s); the etcd backend on its own etcd.
    """
    table = Table(backend)
    try:
        with serving(bench, backend) as server, contextlib.ExitStack() as stack:
            if server is not None:
                try:
                    table.server = f"{server.program} {server.version()}"
                except Broken as err:
                    table.server = f"version unknown: {err}"
                table.etcd = Column() if start_etcd(bench, stack) else None
            steps = {"start-up": startup, "handoff": handoff, "idle waiters": idle}
            steps |= {"contenders": contend, "Python API": python_api}
            steps |= {"hot standby": standby, "cost of each mode": mode_costs}
            for what, step in steps.items():
                began = time.monotonic()
                step(bench, table, effort)
                took = f"{time.monotonic() - began:.1f} s, load {core.load_average()}"
                print(f"{backend}: {what} ({took})", flush=True)
    except Unavailable as err:
        table.skipped = str(err)
        print(f"{backend}: skipped: {err}")
    return table


def startup(bench: Bench, table: Table, effort: Effort) -> None:
    """Time `lockrun … -- true`, `flock FILE true` (…) and the backend's floor, interleaved."""
    scenario = bench.scenario_dir(f"report-startup-{table.backend}")
    lockrun = bench.target(table.backend, scenario)
    commands = {kind: bench.target(kind, scenario).argv("true") for kind in table.kinds}
    commands["floor"] = floor(table.backend, lockrun)[1]
    medians = startup_medians(bench, commands, effort.startup_runs, f"{table.backend} start-up")
    if medians is None:
        return
    for kind in table.kinds:
        table.column(kind).startup = medians[kind]
        table.column(kind).startup_ratio = medians[kind] / medians["floor"]


def handoff(bench: Bench, table: Table, effort: Effort) -> None:
    """Time handoffs of the backend, flock(1) (…), interleaved; a broken one stays empty."""
    labels = {table.backend: f"lockrun, {table.backend} backend", "flock": "flock(1) on a file"}
    labels |= {ETCDCTL_LOCK: "etcdctl lock"} if table.etcd else {}
    results, broken = handoff_trials(bench, labels, effort.handoff_trials)
    for kind in labels.keys() - broken:
        table.column(kind).handoff = results[kind]


def idle(bench: Bench, table: Table, effort: Effort) -> None:
    """Measure the CPU of WAITERS blocked waiters over the window, and their server's.

    As `python -m bench` (c) judges it: the larger of ticks and schedstat's run time counts.
    """
    window = effort.idle_window
    for kind in (table.backend, "flock"):
        if (result := idle_case(bench, kind, 1, WAITERS, window)) is None:
            continue
        for usage, attribute in ((result.usage, "idle"), (result.server, "server")):
            if usage is not None:
                setattr(table.column(kind), attribute, max(usage.cpu, usage.run) / WAITERS / window)


def contend(bench: Bench, table: Table, effort: Effort) -> None:
    """Loop `lockrun -w forever -- true` (or `flock FILE true`) in CONTENDERS processes.

    Each stops after its run once the window has passed: runs per s until the last one exited.
    """
    for kind in (table.backend, "flock"):
        scenario = bench.scenario_dir(f"report-cycles-{kind}")
        stop = scenario / "STOP"
        cycle = ["sh", "-c", CYCLE_SCRIPT, "sh", str(stop)]
        cycle += bench.target(kind, scenario).argv("true", wait=True)
        counts = [scenario / f"count{index}" for index in range(CONTENDERS)]
        try:
            with Processes(scenario) as procs:
                procs.triggers.append(stop)  # whatever happens, the loops end
                began = time.monotonic()
                for count in counts:
                    procs.spawn(cycle, stdout=count)
                time.sleep(effort.idle_window)
                stop.touch()
                procs.finish(60.0)
                elapsed = time.monotonic() - began
        except Broken as err:
            bench.broke(f"{kind}: {CONTENDERS} contenders", err)
            continue
        table.column(kind).cycles = sum(int(count.read_text()) for count in counts) / elapsed


def python_api(bench: Bench, table: Table, effort: Effort) -> None:  # noqa: ARG001 - a step
    """Measure lockrun.Lock beside the peer `python -m bench` targets, with the plan's effort.

    A peer that cannot wait (etcd3gw's Lock) has no contention figures.
    """
    peer = API_TARGETS[table.backend][0]
    entries = [Entry(api.LOCKRUN, table.backend), Entry(peer, table.backend)]
    table.api, table.peer = (ApiColumn(), ApiColumn(waits=peer.waits)), peer.label
    if importlib.util.find_spec(peer.module) is None:
        table.peer += " (not installed)"
        entries.pop()
    times = api_latencies(bench, entries, bench.plan.api)
    waiting = [entry for entry in entries if entry.contender.waits]
    found = api_contention(bench, waiting, bench.plan.api)
    for entry, column in zip(entries, table.api, strict=False):
        if entry.label in times:
            column.median = statistics.median(times[entry.label])
        if (result := found.get(entry.label)) is not None:
            column.rate, column.fairness = result.rate, result.fairness


def standby(bench: Bench, table: Table, effort: Effort) -> None:  # noqa: ARG001 - a step
    """Time the hot-standby fail-overs of the backend (bench/modes.py)."""
    table.standby = modes.standby(bench, table.backend, modes.trials(bench))


def mode_costs(bench: Bench, table: Table, effort: Effort) -> None:
    """Time each mode's uncontended cycle beside the plain one's, and take-overs."""
    runs = effort.startup_runs
    table.modes = modes.mode_costs(bench, table.backend, runs, modes.trials(bench))


def cell(value: float | None, form: str = ".2f") -> str:
    """Return *value* as a table cell in *form*, or `broke` when it was not measured."""
    return "broke" if value is None else format(value, form)


def table_lines(table: Table, effort: Effort) -> list[str]:
    """Return one backend's Markdown section."""
    lines = [f"## {table.backend}", ""]
    if table.skipped:
        return [*lines, f"Not measured: {table.skipped}.", ""]
    if table.server:
        lines += [f"Against a throwaway {table.server} of the bench's own, over loopback TCP.", ""]
    tools = [table.column(kind) for kind in table.kinds]
    trials = len(table.lockrun.handoff) or effort.handoff_trials

    def tail(column: Column, percent: int) -> str:
        return cell(core.percentile(column.handoff, percent)) if column.handoff else "broke"

    rows = {
        "start-up, median ms": [cell(c.startup and c.startup * 1000, ".1f") for c in tools],
        "start-up ratio, over the floor": [cell(c.startup_ratio) for c in tools],
        f"handoff p50, ms ({trials} trials)": [tail(c, 50) for c in tools],
        f"handoff p99, ms ({trials} trials)": [tail(c, 99) for c in tools],
    }
    per_waiter = f"s per waiter per s ({WAITERS} waiters)"
    local = {f"idle-waiter CPU, {per_waiter}": [cell(c.idle, ".2g") for c in tools[:2]]}
    if table.backend in SERVED:  # a CPU share: two significant digits, maybe an exponent
        local[f"server CPU, {per_waiter}"] = [cell(table.lockrun.server, ".2g"), "—"]
    local[f"acquire/release cycles per s, {CONTENDERS} contenders"] = [
        cell(c.cycles, ".1f") for c in tools[:2]
    ]
    rows |= {what: cells + ["—"] * (len(tools) - 2) for what, cells in local.items()}
    names = ["lockrun", "flock(1)", "`etcdctl lock`"][: len(tools)]
    lines += [f"| metric | {' | '.join(names)} |", f"|---|{'---:|' * len(tools)}"]
    lines += [f"| {what} | {' | '.join(cells)} |" for what, cells in rows.items()]
    return [*lines, ""]


def api_lines(tables: Sequence[Table]) -> list[str]:
    """Return the Python API section: lockrun.Lock beside each backend's peer."""
    measured = [table for table in tables if table.api]
    if not measured:
        return []
    lines = [
        "## Python API",
        "",
        (
            "| backend | peer | acquire+release median µs, lockrun | peer "
            f"| cycles per s, {CONTENDING} processes, lockrun | peer "
            "| fewest / most cycles of one process, lockrun | peer |"
        ),
        f"|---|---|{'---:|' * 6}",
    ]
    for table in measured:
        both = table.api or ()
        cells = [cell(c.median, ".1f") for c in both]
        cells += [cell(c.rate, ".0f") if c.waits else "—" for c in both]
        cells += [cell(c.fairness) if c.waits else "—" for c in both]
        lines.append(f"| {table.backend} | {table.peer} | {' | '.join(cells)} |")
    return [*lines, ""]


def spread_cell(values: Sequence[float]) -> str:
    """Return "median / max" of *values* (ms): a decimal below 100 ms, whole ms above."""
    if not values:
        return "broke"
    form = ".1f" if max(values) < 100 else ".0f"
    return f"{statistics.median(values):{form}} / {max(values):{form}}"


def paragraph(text: str) -> list[str]:
    """Return *text* as Markdown lines of at most 90 characters, and an empty line."""
    return [*textwrap.wrap(text, 90, break_on_hyphens=False), ""]


def standby_lines(tables: Sequence[Table], bench: Bench) -> list[str]:
    """Return the "Hot standby fail-over" section: a row per backend, a column per fault."""
    measured = [table for table in tables if table.standby is not None]
    if not measured:
        return []
    ttl, lease = f"{modes.TTL:g}", " ".join(modes.LEASE)
    lines = [f"## {STANDBY_HEADING}", ""]
    lines += paragraph(
        f"Two `lockrun --wait forever {lease} -- daemon` on this machine, the second queued"
        " behind the first, as in [deployment.md](deployment.md#hot-standby);"
        f" {modes.trials(bench)} trials of each fault: the time from the active daemon's end,"
        " or from the cut, to the standby's daemon starting; median / max in ms."
    )
    lines += [
        "- **clean stop**: TERM to the active lockrun, which passes it on to the daemon and",
        "  releases the lock once the daemon has exited.",
        "- **crash**: SIGKILL of the active lockrun and of its daemon's process group.",
        "- **host cut off** (a server backend): the active lockrun's link to the server, a",
        "  proxy, goes silent; nothing tells the server. **cut-off daemon stopped**: from the",
        "  cut to the cut-off daemon's end, which lockrun brought about (exit 76) before the",
        "  standby's daemon started, in every trial (the bench checks).",
        "",
    ]
    lines += paragraph(
        "A crash on Redis or etcd and a cut wait out what is left of a lease, at most a ttl"
        f" ({ttl} s here; on etcd, which looks for expired leases every half second, up to"
        " that much more): they scale with `--ttl`. The rest is a hand-over."
    )
    lines += [
        "| backend | clean stop | crash | host cut off | cut-off daemon stopped |",
        f"|---|{'---:|' * 4}",
    ]
    for table in measured:
        found = table.standby or {}
        cells = [
            "—" if (failovers := found.get(fault)) is None else spread_cell(failovers.times)
            for fault in (modes.CLEAN, modes.CRASH, modes.CUT)
        ]
        cut = found.get(modes.CUT)
        cells.append("—" if cut is None else spread_cell(cut.stopped))
        lines.append(f"| {table.backend} | {' | '.join(cells)} |")
    return [*lines, ""]


def mode_lines(tables: Sequence[Table], effort: Effort, bench: Bench) -> list[str]:
    """Return the "Cost of each mode" section: ratios to a plain run, and take-overs."""
    measured = [table for table in tables if table.modes is not None]
    if not measured:
        return []
    plain, *labels = modes.MODES
    lines = [f"## {MODES_HEADING}", ""]
    lines += paragraph(
        "An uncontended `lockrun --uri URI -n NAME [MODE] -- true`, every run on a fresh name,"
        f" the modes interleaved, {effort.startup_runs} runs each after one to warm up: the"
        " plain run's median in ms, and each mode's median over it."
        f" `--hold-at-least {modes.WINDOW}` still has its window open at release: what leaving"
        f" the marker costs. `--take-over --wait {modes.TAKER_WAIT:g}` on a free lock."
    )
    lines += paragraph(
        f"**Take-over**, {modes.trials(bench)} trials: a holder (`--ttl {modes.TTL:g}`) runs and"
        " a taker starts; the time from the taker's start to its command's (its own start-up,"
        " the holder's notice and stop, the hand-over), and to the holder's command getting TERM"
        " (the notice); median / max in ms. **unsupported**: the backend did not do what the"
        " mode asks (why follows the table)."
    )
    modes_header = " | ".join(f"`{label}`, × plain" for label in labels)
    lines += [
        (
            f"| backend | {plain}, median ms | {modes_header} | take-over: taker's command"
            " | take-over: holder's TERM |"
        ),
        f"|---|{'---:|' * (len(labels) + 3)}",
    ]
    reasons = []
    for table in measured:
        costs = table.modes or modes.ModeCosts()

        def shown(label: str, text: str, costs: modes.ModeCosts = costs) -> str:
            return "unsupported" if label in costs.unsupported else text

        median = costs.medians.get(plain)
        cells = [shown(plain, cell(None if median is None else median * 1000, ".1f"))]
        cells += [shown(label, cell(costs.ratio(label))) for label in labels]
        cells += [
            shown(modes.TAKE_OVER, spread_cell(found)) for found in (costs.takeover, costs.notice)
        ]
        lines.append(f"| {table.backend} | {' | '.join(cells)} |")
        reasons += [
            f"- {table.backend}, `{what}`: {why}" for what, why in costs.unsupported.items()
        ]
    return [*lines, "", *reasons, *([""] if reasons else [])]


def header_lines(bench: Bench, command: str, loads: tuple[str, str], effort: Effort) -> list[str]:
    """Return the report's title, the machine and run it describes, and what the rows mean."""
    window, plan = f"{effort.idle_window:g} s", bench.plan.api
    missing = [program for program in ("etcd", "etcdctl") if shutil.which(program) is None]
    etcd = f" (not measured: {' and '.join(missing)} not on PATH)" if missing else ""
    return [
        "# lockrun benchmarks",
        "",
        "Measured in one run on one machine by `python -m bench.report`; other work on the",
        "machine skews every number. `python -m bench` measures more (FIFO order, semaphores,",
        "the unix sockets) with targets and verdicts.",
        "",
        "| | |",
        "|---|---|",
        f"| date | {time.strftime('%Y-%m-%d %H:%M:%S %z')} |",
        f"| kernel | Linux {platform.release()} on {platform.machine()} |",
        f"| CPUs | {os.cpu_count()} |",
        f"| Python | {platform.python_version()} |",
        f"| lockrun | {bench.version()} |",
        f"| load average (1, 5, 15 min) | {loads[0]} at the start, {loads[1]} at the end |",
        f"| command | `{command}` |",
        "",
        "What the rows measure, lockrun and flock(1) alike, in the same run; beside a server",
        f"backend, `etcdctl lock` too, on a throwaway etcd of the bench's own{etcd} (beside the",
        "etcd backend, on the very etcd lockrun uses):",
        "",
        "- **start-up**: median wall time of `lockrun --uri URI -- true`, `flock FILE true` and",
        "  `etcdctl lock NAME -- true`; the ratio divides it by the median of the backend's",
        "  floor, as `python -m bench` does: `python -c` importing click and the driver,",
        "  connecting and one round trip (PING, SELECT 1; on etcd, `socket`, `json` and",
        "  `base64`, and one `POST /v3/kv/range` written on the socket by hand, the least of",
        "  lockrun's own HTTP); for file: and",
        "  abstract:, importing click and one open and flock(2).",
        "- **handoff**: from the holder's command exiting to the waiter's command starting",
        "  (both print a `date +%s%N`), the waiter queued with `--wait forever`.",
        "",
        "How each peer is run, so that no side of a ratio is handicapped:",
        "",
        "- **A waiter counts as queued only once it can be woken**: lockrun's once it sleeps in",
        "  the lock's own queue (a blocked entry in /proc/locks, BLPOP, GET_LOCK,",
        "  an ungranted advisory lock); `etcdctl lock`'s once etcd's own gauges show its watch",
        "  on the key ahead of it *synced*. etcd 3.4 starts that watch unsynced and catches it",
        "  up every 100 ms, so releasing the holder as soon as the waiter's key appears (as",
        "  this bench once did) timed etcd's catch-up, 0–100 ms, not its hand-over. A lockrun",
        "  waiter on etcd is held to the same rule: its queue key (whose record names its pid)",
        "  and a synced watch for each waiter.",
        "- **Every server keeps its production durability**: PostgreSQL with fsync on (its",
        "  default; the test suite's servers turn it off), MariaDB flushing InnoDB's log at",
        "  every commit (its default), etcd's data on the disk, Redis appending to its AOF",
        "  (fsync once a second). A flush lockrun forces per grant is in its figures.",
        "- **Floors connect the cheapest equivalent way**: PyMySQL with `ssl_disabled=True`,",
        "  as lockrun's own connection skips the CA store when no TLS is asked for; etcd's",
        "  floor and raw peer set TCP_NODELAY, as lockrun does (`http.client`, the raw",
        "  peer's, writes a body apart from its headers).",
        "- **Start-ups alternate** (every command once per round), and bytecode is compiled",
        "  first, as `pip install` does.",
        f"- **idle-waiter CPU**: {WAITERS} waiters blocked on a held lock for {window}: the CPU",
        "  seconds each used per second, the larger of /proc's tick count and schedstat's exact",
        "  run time. For a server backend, the server's CPU over the same window, per waiter",
        "  (etcd, which also ticks its raft and Go runtime, spends a few ms per s alone).",
        f"- **cycles**: {CONTENDERS} processes, each looping",
        "  `lockrun --uri URI -n NAME -w forever -- true` (or `flock FILE true`) for",
        f"  {window}: completed runs per second, all of them together.",
        "- **Python API**: `lockrun.Lock(name, uri=URI, wait=None)`, one object reused",
        "  (`with lock: pass`), beside the peer `python -m bench` holds it to, each in a process",
        f"  of its own: the acquire+release median of {plan.rounds} × {plan.cycles} cycles in one",
        f"  process, after {plan.warmup} to warm up; then {CONTENDING} processes cycling on one",
        f"  name, {plan.contend_rounds} × {plan.window:g} s: cycles per second, all together, and",
        "  the fewest cycles of one process over the most (1: each had as many). On etcd the",
        "  peer is etcd3gw's `Lock` (OpenStack's client of the same JSON gateway, on `requests`):",
        "  a lease grant and a put-if-absent, then a delete; it cannot wait (its acquire says",
        "  False), so it has no contention figures (—). `python -m bench` also runs etcd's own",
        "  lock service (v3lock, `etcdctl lock`'s queue run in the server) over `http.client`:",
        "  a lease grant, `Lock`, which waits, and a revoke per cycle, as lockrun grants a",
        "  lease per acquire: the raw primitive its contention target is taken against.",
        "",
        f"![Handoff latency per backend, beside flock(1)]({PLOT_NAME})",
        "",
    ]


def plot(path: Path, tables: Sequence[Table]) -> None:
    """Draw each backend's handoff latencies beside flock(1)'s, as box plots on a log axis."""
    # The bench extra is optional: main imported matplotlib and chose Agg.
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

    measured = [table for table in tables if table.lockrun.handoff and table.flock.handoff]
    figure, axes = plt.subplots(figsize=(max(6.4, 1.7 * len(measured) + 2.0), 5.2), dpi=120)
    tools = (("lockrun", "tab:blue", -0.2), ("flock(1)", "tab:gray", 0.2))
    for place, table in enumerate(measured):
        for (_, color, offset), column in zip(tools, (table.lockrun, table.flock), strict=True):
            line, box = {"color": color}, {"facecolor": color, "alpha": 0.35, "edgecolor": color}
            style: dict[str, Any] = {"boxprops": box, "whiskerprops": line, "capprops": line}
            style |= {"medianprops": line | {"linewidth": 2}, "widths": 0.32, "whis": (1, 99)}
            style |= {"flierprops": {"marker": ".", "markeredgecolor": color, "markersize": 4}}
            axes.boxplot(column.handoff, positions=[place + offset], patch_artist=True, **style)
    axes.set_yscale("log")
    axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.yaxis.set_minor_formatter(NullFormatter())
    axes.set_xticks(range(len(measured)))
    axes.set_xticklabels([tick_label(table) for table in measured])
    axes.set_xlim(-0.6, len(measured) - 0.4)
    axes.set_ylabel("handoff latency (ms, log scale)")
    axes.grid(visible=True, axis="y", which="both", alpha=0.3)
    figure.suptitle("Handoff: holder's command exits → waiter's command starts")
    handles = [Patch(facecolor=c, alpha=0.35, edgecolor=c, label=tool) for tool, c, _ in tools]
    figure.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.95), ncols=2, frameon=False
    )
    key = "box: quartiles · thick line: median · whiskers: 1st–99th percentile · dots: beyond"
    figure.text(0.5, 0.01, key, ha="center", fontsize=8, color="dimgray")
    figure.tight_layout(rect=(0, 0.03, 1, 0.92))
    figure.savefig(path)
    plt.close(figure)


def tick_label(table: Table) -> str:
    """Return a backend's label under its boxes: name, trials, both medians."""
    lockrun, flock = (statistics.median(column.handoff) for column in (table.lockrun, table.flock))
    return (
        f"{table.backend}, n={len(table.lockrun.handoff)}\nmedians {lockrun:.2f} | {flock:.2f} ms"
    )


def backend_list(text: str) -> list[str]:
    """Parse --backends: a comma-separated subset of BACKENDS, kept in BACKENDS' order."""
    wanted = {item.strip() for item in text.split(",") if item.strip()}
    if wanted - set(BACKENDS) or not wanted:
        msg = f"choose from {','.join(BACKENDS)}, not {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return [backend for backend in BACKENDS if backend in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, then write the report and the plot."""
    about = __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=about)
    parser.add_argument("--quick", action="store_true", help="few trials, short windows")
    parser.add_argument("--out", type=Path, default=DOCS, help=f"where to write (default {DOCS})")
    choices = f"comma-separated subset of {','.join(BACKENDS)}"
    parser.add_argument("--backends", type=backend_list, default=list(BACKENDS), help=choices)
    args = parser.parse_args(argv)
    try:
        import matplotlib as mpl  # noqa: PLC0415 - the bench extra is optional
    except ImportError as err:
        print(
            f"{parser.prog}: needs matplotlib ({err}): pip install -e '.[bench]'", file=sys.stderr
        )
        return 2
    mpl.use("Agg")  # files only, never a window
    command = shlex.join([*parser.prog.split(), *(sys.argv[1:] if argv is None else argv)])
    effort = QUICK_EFFORT if args.quick else FULL_EFFORT
    began, load = time.monotonic(), core.load_average()
    print(f"bytecode {core.compile_bytecode()}")
    # The report's own effort but for the Python API's, which is the plan's.
    with Bench.running(core.QUICK if args.quick else core.FULL) as bench:
        tables = [measure(bench, backend, effort) for backend in args.backends]
        args.out.mkdir(parents=True, exist_ok=True)
        lines = header_lines(bench, command, (load, core.load_average()), effort)
        lines += [line for table in tables for line in table_lines(table, effort)]
        lines += api_lines(tables)
        lines += standby_lines(tables, bench)
        lines += mode_lines(tables, effort, bench)
        (args.out / REPORT_NAME).write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
        plot(args.out / PLOT_NAME, tables)
        print(f"wrote {args.out / REPORT_NAME} and {args.out / PLOT_NAME}")
        return bench.finish(began)


if __name__ == "__main__":
    sys.exit(main())
