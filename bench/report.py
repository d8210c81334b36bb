"""Write lockrun's benchmark report: one Markdown table per backend beside flock(1), and a plot.

Run it from the repository root as ``python -m bench.report [--quick] [--out DIR]
[--backends file,abstract,…]``. For each backend it measures start-up, handoff latency, the
CPU of idle waiters and the acquire/release cycles of 8 contenders, each with flock(1) in the
same run, and writes ``benchmarks.md`` and ``handoff-latency.png`` into DIR (the repository's
``docs/`` by default). The exit status is 1 when something broke (listed at the end), 2
without matplotlib.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from bench.core import (
    FLOCK,
    QUICK,
    SERVED,
    Bench,
    Broken,
    Effort,
    Processes,
    catch_term,
    compile_bytecode,
    find_lockrun,
    load_average,
    lockrun_version,
    make_target,
    percentile,
    problems,
)
from bench.measure import handoff_trials, idle_case, imports, time_commands
from bench.servers import Unavailable, serving
from lockrun.uri import BACKENDS

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from bench.measure import IdleResult

WAITERS: Final = 8  # idle waiters queued on a held lock
CONTENDERS: Final = 8  # processes looping acquire, run `true`, release
# One contender: run the command until STOP exists, then print how many runs completed.
CYCLE_SCRIPT: Final = (
    'stop=$1; shift; n=0; while [ ! -e "$stop" ]; do "$@" || exit; n=$((n + 1)); done; echo "$n"'
)
ETCD: Final = ("etcd", "etcdctl")
NOT_MEASURED: Final = "—"
PLOT_NAME: Final = "handoff-latency.png"
REPORT_NAME: Final = "benchmarks.md"
DOCS: Final = Path(__file__).resolve().parent.parent / "docs"
# The contenders loop as long as the idle waiters wait: idle_window is their window too.
FULL_EFFORT: Final = Effort(
    startup_runs=30, handoff_trials=100, idle_waiters=WAITERS, idle_window=10.0
)
QUICK_EFFORT: Final = Effort(
    startup_runs=5, handoff_trials=8, idle_waiters=WAITERS, idle_window=0.5
)


@dataclass
class Column:
    """One tool's numbers in a backend's table; None where the measurement broke."""

    startup: float | None = None  # median seconds
    startup_ratio: float | None = None  # over the backend's `python -c 'import …'`
    handoff: list[float] = field(default_factory=list)  # milliseconds
    idle: float | None = None  # CPU seconds per waiter per second
    server: float | None = None  # the lock server's CPU seconds per waiter per second
    cycles: float | None = None  # per second, all contenders together


@dataclass
class Table:
    """What one backend's section says: lockrun's numbers, flock(1)'s, or why it was skipped."""

    backend: str
    lockrun: Column = field(default_factory=Column)
    flock: Column = field(default_factory=Column)
    server: str = ""  # the server's name and version
    skipped: str = ""


# -- measuring -----------------------------------------------------------------------------


def measure(bench: Bench, backend: str, effort: Effort) -> Table:
    """Measure *backend* and flock(1) side by side, with the backend's server if it needs one."""
    table = Table(backend)
    try:
        with serving(bench, backend) as server:
            if server is not None:
                try:
                    table.server = f"{server.program} {server.version()}"
                except Broken as err:
                    table.server = f"version unknown: {err}"
            steps: dict[str, Callable[[Bench, Table, Effort], None]] = {
                "start-up": startup,
                "handoff": handoff,
                "idle waiters": idle,
                "contenders": contend,
            }
            for what, step in steps.items():
                began = time.monotonic()
                step(bench, table, effort)
                print(
                    f"{backend}: {what} ({time.monotonic() - began:.1f} s, load {load_average()})"
                )
                sys.stdout.flush()
    except Unavailable as err:
        table.skipped = str(err)
        print(f"{backend}: skipped: {err}")
    return table


def startup(bench: Bench, table: Table, effort: Effort) -> None:
    """Time `lockrun … -- true`, `flock FILE true` and the backend's bare imports, interleaved."""
    scenario = bench.scenario_dir(f"report-startup-{table.backend}")
    target = make_target(bench, table.backend, scenario)
    commands = {
        "lockrun": target.argv(bench.lockrun, ["true"]),
        "flock": [FLOCK, str(scenario / "x"), "true"],
        "imports": [sys.executable, "-c", f"import {imports([table.backend])}"],
    }
    try:
        times = time_commands(commands, effort.startup_runs)
    except subprocess.CalledProcessError as err:
        bench.broke(f"{table.backend} start-up", Broken(f"exit {err.returncode} from {err.cmd}"))
        return
    bare = statistics.median(times["imports"])
    for column, label in ((table.lockrun, "lockrun"), (table.flock, "flock")):
        column.startup = statistics.median(times[label])
        column.startup_ratio = column.startup / bare


def handoff(bench: Bench, table: Table, effort: Effort) -> None:
    """Time handoffs of the backend and of flock(1), interleaved; a broken one stays empty."""
    labels = {table.backend: f"lockrun, {table.backend} backend", "flock": "flock(1) on a file"}
    results, broken = handoff_trials(bench, labels, effort.handoff_trials)
    if table.backend not in broken:
        table.lockrun.handoff = results[table.backend]
    if "flock" not in broken:
        table.flock.handoff = results["flock"]


def idle(bench: Bench, table: Table, effort: Effort) -> None:
    """Measure the CPU of WAITERS blocked waiters over the window, and their server's."""
    window = effort.idle_window
    for kind, column in ((table.backend, table.lockrun), ("flock", table.flock)):
        result = idle_case(bench, kind, 1, WAITERS, window)
        if result is None:
            continue
        column.idle = per_waiter(result, window)
        if result.server is not None:
            usage = result.server.usage
            column.server = max(usage.cpu, usage.run) / WAITERS / window


def per_waiter(result: IdleResult, window: float) -> float:
    """Return the waiters' CPU seconds per waiter per second of the window.

    As `python -m bench` (c) judges it, the larger of the two counts: /proc's clock ticks miss short
    children below a tick, the exact schedstat run time misses processes that ended.
    """
    return max(result.usage.cpu, result.usage.run) / WAITERS / window


def contend(bench: Bench, table: Table, effort: Effort) -> None:
    """Count the acquire/release cycles per second of CONTENDERS looping processes."""
    for kind, column in ((table.backend, table.lockrun), ("flock", table.flock)):
        try:
            column.cycles = cycle_rate(bench, kind, effort.idle_window)
        except Broken as err:
            bench.broke(f"{kind}: {CONTENDERS} contenders", err)


def cycle_rate(bench: Bench, kind: str, window: float) -> float:
    """Loop `lockrun -w forever -- true` (or `flock FILE true`) in CONTENDERS processes.

    Each stops after the run in progress once *window* has passed; every completed run is
    counted, over the time until the last contender exited.
    """
    scenario = bench.scenario_dir(f"report-cycles-{kind}")
    target = make_target(bench, kind, scenario)
    stop = scenario / "STOP"
    cycle = target.argv(bench.lockrun, ["true"], wait=True)
    counts = [scenario / f"count{index}" for index in range(CONTENDERS)]
    with Processes(scenario) as procs:
        procs.triggers.append(stop)  # whatever happens, the loops end
        began = time.monotonic()
        for count in counts:
            procs.spawn(["sh", "-c", CYCLE_SCRIPT, "sh", str(stop), *cycle], stdout=count)
        time.sleep(window)
        stop.touch()
        procs.finish(60.0)
        elapsed = time.monotonic() - began
    return sum(int(count.read_text()) for count in counts) / elapsed


# -- writing -------------------------------------------------------------------------------


def number(value: float | None, digits: int = 2) -> str:
    """Return *value* as a table cell: fixed decimals, or `broke` when it was not measured."""
    return "broke" if value is None else f"{value:.{digits}f}"


def milliseconds(seconds: float | None) -> float | None:
    """Return *seconds* in milliseconds, None staying None."""
    return None if seconds is None else seconds * 1000


def small(value: float | None) -> str:
    """Return a CPU share as a table cell: two significant digits, which may be an exponent."""
    return "broke" if value is None else f"{value:.2g}"


def table_lines(table: Table, effort: Effort) -> list[str]:
    """Return one backend's Markdown section."""
    lines = [f"## {table.backend}", ""]
    if table.skipped:
        return [*lines, f"Not measured: {table.skipped}.", ""]
    if table.server:
        lines += [f"Against a throwaway {table.server} of the bench's own, over loopback TCP.", ""]
    columns = (table.lockrun, table.flock)
    trials = len(table.lockrun.handoff) or effort.handoff_trials

    def handoff_cell(column: Column, percent: int) -> str:
        return number(percentile(column.handoff, percent)) if column.handoff else "broke"

    rows = [
        ("start-up, median ms", [number(milliseconds(c.startup), 1) for c in columns]),
        (
            f"start-up ratio, over `python -c 'import {imports([table.backend])}'`",
            [number(c.startup_ratio) for c in columns],
        ),
        (f"handoff p50, ms ({trials} trials)", [handoff_cell(c, 50) for c in columns]),
        (f"handoff p99, ms ({trials} trials)", [handoff_cell(c, 99) for c in columns]),
        (
            f"idle-waiter CPU, s per waiter per s ({WAITERS} waiters)",
            [small(c.idle) for c in columns],
        ),
    ]
    if table.backend in SERVED:
        rows.append(
            (
                f"server CPU, s per waiter per s ({WAITERS} waiters)",
                [small(table.lockrun.server), NOT_MEASURED],
            )
        )
    rows.append(
        (
            f"acquire/release cycles per s, {CONTENDERS} contenders",
            [number(c.cycles, 1) for c in columns],
        )
    )
    lines += ["| metric | lockrun | flock(1) |", "|---|---:|---:|"]
    lines += [f"| {what} | {' | '.join(cells)} |" for what, cells in rows]
    return [*lines, ""]


def etcd_note() -> str:
    """Return the line that says why there is no `etcdctl lock` column."""
    missing = [program for program in ETCD if shutil.which(program) is None]
    if missing:
        return f"`etcdctl lock`: not measured, {' and '.join(missing)} not installed (not on PATH)."
    return "`etcdctl lock`: not measured, the report has no etcd column yet."


def header_lines(bench: Bench, command: str, loads: tuple[str, str], effort: Effort) -> list[str]:
    """Return the report's title, the machine and run it describes, and what the rows mean."""
    version = lockrun_version(bench)
    window = f"{effort.idle_window:g} s"
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
        f"| lockrun | {version} |",
        f"| load average (1, 5, 15 min) | {loads[0]} at the start, {loads[1]} at the end |",
        f"| command | `{command}` |",
        "",
        "What the rows measure, lockrun and flock(1) alike, in the same run:",
        "",
        "- **start-up**: median wall time of `lockrun --uri URI -- true` and `flock FILE true`;",
        "  the ratio divides it by the median of `python -c 'import click'` plus the backend's",
        "  driver, as `python -m bench` (a), (e), (i) and (m) do.",
        "- **handoff**: from the holder's command exiting to the waiter's command starting",
        "  (both print a `date +%s%N`), the waiter queued with `--wait forever`.",
        f"- **idle-waiter CPU**: {WAITERS} waiters blocked on a held lock for {window}: the CPU",
        "  seconds each used per second, the larger of /proc's tick count and schedstat's exact",
        "  run time. For a server backend, the server's CPU over the same window, per waiter.",
        f"- **cycles**: {CONTENDERS} processes, each looping",
        "  `lockrun --uri URI -n NAME -w forever -- true` (or `flock FILE true`) for",
        f"  {effort.idle_window:g} s: completed runs per second, all of them together.",
        "",
        etcd_note(),
        "",
        f"![Handoff latency per backend, beside flock(1)]({PLOT_NAME})",
        "",
    ]


def write_report(path: Path, header: list[str], tables: Sequence[Table], effort: Effort) -> None:
    """Write the Markdown report."""
    lines = list(header)
    for table in tables:
        lines += table_lines(table, effort)
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")


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
            axes.boxplot(
                column.handoff,
                positions=[place + offset],
                widths=0.32,
                whis=(1, 99),
                patch_artist=True,
                boxprops={"facecolor": color, "alpha": 0.35, "edgecolor": color},
                medianprops={"color": color, "linewidth": 2},
                whiskerprops={"color": color},
                capprops={"color": color},
                flierprops={"marker": ".", "markeredgecolor": color, "markersize": 4},
            )
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
    handles = [
        Patch(facecolor=color, alpha=0.35, edgecolor=color, label=tool) for tool, color, _ in tools
    ]
    figure.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.95), ncols=2, frameon=False
    )
    figure.text(
        0.5,
        0.01,
        "box: quartiles · thick line: median · whiskers: 1st–99th percentile · dots: beyond",
        ha="center",
        fontsize=8,
        color="dimgray",
    )
    figure.tight_layout(rect=(0, 0.03, 1, 0.92))
    figure.savefig(path)
    plt.close(figure)


def tick_label(table: Table) -> str:
    """Return a backend's label under its boxes: name, trials, both medians."""
    lockrun, flock = (statistics.median(column.handoff) for column in (table.lockrun, table.flock))
    trials = len(table.lockrun.handoff)
    return f"{table.backend}, n={trials}\nmedians {lockrun:.2f} | {flock:.2f} ms"


# -- main ----------------------------------------------------------------------------------


def backend_list(text: str) -> list[str]:
    """Parse --backends: a comma-separated subset of BACKENDS, kept in BACKENDS' order."""
    wanted = {item.strip() for item in text.split(",") if item.strip()}
    unknown = wanted - set(BACKENDS)
    if unknown or not wanted:
        msg = f"choose from {','.join(BACKENDS)}, not {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return [backend for backend in BACKENDS if backend in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, then write the report and the plot."""
    catch_term()
    parser = argparse.ArgumentParser(
        prog="python -m bench.report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="few trials, short windows")
    parser.add_argument("--out", type=Path, default=DOCS, help=f"where to write (default {DOCS})")
    parser.add_argument(
        "--backends",
        type=backend_list,
        default=list(BACKENDS),
        help=f"comma-separated subset of {','.join(BACKENDS)}",
    )
    args = parser.parse_args(argv)
    try:
        import matplotlib as mpl  # noqa: PLC0415 - the bench extra is optional
    except ImportError as err:
        print(
            f"python -m bench.report: needs matplotlib ({err}): pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    mpl.use("Agg")  # files only, never a window
    command = shlex.join(
        ["python", "-m", "bench.report", *(sys.argv[1:] if argv is None else argv)]
    )
    effort = QUICK_EFFORT if args.quick else FULL_EFFORT
    began, load = time.monotonic(), load_average()
    print(f"bytecode {compile_bytecode()}")
    root = Path(tempfile.mkdtemp(prefix="lockrun-report-"))
    bench = Bench(find_lockrun(), root, QUICK)  # the report's own effort, not the plan's
    try:
        tables = [measure(bench, backend, effort) for backend in args.backends]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    header = header_lines(bench, command, (load, load_average()), effort)
    write_report(args.out / REPORT_NAME, header, tables, effort)
    plot(args.out / PLOT_NAME, tables)
    print(f"wrote {args.out / REPORT_NAME} and {args.out / PLOT_NAME}")
    print(f"finished in {time.monotonic() - began:.1f} s; load {load_average()}")
    return problems(bench)


if __name__ == "__main__":
    sys.exit(main())
