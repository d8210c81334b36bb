"""Benchmark lockrun: startup, handoff latency, idle waiters' CPU and FIFO order, per backend.

Run it from the repository root as ``python -m bench [--quick]``. It prints one plain-text
report measured in this one run; a missed target is a MISS line, not a failure. The local
backends are measured together, then each server backend against a throwaway server of the
bench's own (tests/support/servers.py's: a fresh data directory, a loopback TCP port and a
unix socket; never the machine's own server), skipped with the reason when its server (or its
driver) is not installed or does not start, and stopped and removed at the end whatever
happens. The exit status is 1 only when something broke (lockrun crashed, hung or exited with
a status it should not have); every such problem is listed at the end with its command line.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.core import (
    FLOCK,
    FULL,
    QUICK,
    WIDTH,
    Bench,
    catch_term,
    compile_bytecode,
    find_lockrun,
    load_average,
    lockrun_version,
    machine,
    problems,
    row,
    section,
)
from bench.measure import SECTIONS, Group, groups
from bench.servers import Unavailable, serving

if TYPE_CHECKING:
    from collections.abc import Sequence


def header(bench: Bench, quick: bool) -> None:
    """Print when, where and what was measured."""
    print("lockrun benchmark" + (" (--quick)" if quick else ""))
    print("=" * WIDTH)
    print(f"date     {time.strftime('%Y-%m-%d %H:%M:%S %z')}")
    print(f"kernel   {machine()}")
    print(f"python   {platform.python_version()} ({sys.executable})")
    print(f"lockrun  {lockrun_version(bench)} ({shlex.join(bench.lockrun)})")
    print(f"bytecode {compile_bytecode()}")
    print(f"flock    {FLOCK}")
    print(f"load     {load_average()} (other work on the machine skews every number)")
    print("columns: what, numbers, target, verdict (no target: for reference)")


def measure(bench: Bench, group: Group) -> None:
    """Run the group's four sections, with its server; each says how long it took."""
    try:
        with serving(bench, group.backends[0]):
            for run in SECTIONS:
                began = time.monotonic()
                run(bench, group)
                print(f"  ({time.monotonic() - began:.1f} s, load {load_average()})")
                sys.stdout.flush()
    except Unavailable as err:
        section(f"({group.letters[0]}) to ({group.letters[-1]}) {group.title}: skipped")
        row(f"{group.backends[0]} backend", f"skipped: {err}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every section once and print the report."""
    catch_term()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke)")
    quick = parser.parse_args(argv).quick
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="lockrun-bench-"))
    bench = Bench(find_lockrun(), root, QUICK if quick else FULL)
    try:
        header(bench, quick)
        for group in groups(bench):
            measure(bench, group)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nfinished in {time.monotonic() - began:.1f} s; load {load_average()}")
    return problems(bench)


if __name__ == "__main__":
    sys.exit(main())
