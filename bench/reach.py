"""What #13's reach costs, as ratios from one run: ``python -m bench.reach [--quick]``.

From the repository root, on the machine's services (Redis on 127.0.0.1:6379). Each line
is a median of interleaved runs, in ms, and a ratio against its baseline in the same run:

- **One file**: ``lockrun.pyz`` (scripts/build-pyz, run by the system's Python) against the
  installed ``lockrun``: ``--version``, and a run of ``true`` under a ``file:`` lock.
- **A locked section**: ``lockrun acquire`` then ``lockrun release`` (a keeper; on Redis
  also ``--no-keeper``) against one ``lockrun -- true``, and against flock(1)'s fd form
  (``exec 9>f; flock 9; …; flock -u 9``): what a section of a script costs.
- **Monitoring**: a run with ``--on-start true``, one with ``--on-exit true``, and one with
  ``--metrics-file``, against the plain run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Final

from bench.core import compile_bytecode, load_average, row, section

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

ROOT: Final = Path(__file__).resolve().parent.parent
LOCKRUN: Final = str(Path(sys.executable).with_name("lockrun"))
SYSTEM_PYTHON: Final = "/usr/bin/python3"
REDIS: Final = "redis://127.0.0.1:6379/0"
RUNS: Final = 30
QUICK_RUNS: Final = 5
# Issue 32's targets: the .pyz (which ships bytecode for the build's Python) against the
# installed command; a hook or the metrics file against the plain run.
TARGETS: Final = {"pyz run of true": 1.3, "--on-exit true": 1.1, "--metrics-file": 1.1}


def quiet(*argv: str) -> str:
    """Run *argv*; return its stdout, or raise with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        msg = f"exit {done.returncode} from {' '.join(argv)}: {done.stderr.strip()}"
        raise RuntimeError(msg)
    return done.stdout


def medians(cases: Mapping[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Time each case *runs* times, round-robin after one warm-up round; medians in ms."""
    times: dict[str, list[float]] = {label: [] for label in cases}
    for attempt in range(runs + 1):
        for label, case in cases.items():
            began = time.perf_counter()
            case()
            if attempt:
                times[label].append((time.perf_counter() - began) * 1000)
    return {label: statistics.median(values) for label, values in times.items()}


def report(found: dict[str, float], baseline: str) -> None:
    """Print each median and its ratio over *baseline*'s, with a verdict where TARGETS has one."""
    for label, median in found.items():
        if label == baseline:
            row(label, f"median {median:7.1f} ms")
            continue
        ratio = median / found[baseline]
        numbers = f"median {median:7.1f} ms, {ratio:5.2f}x {baseline}"
        if (most := TARGETS.get(label)) is None:
            row(label, numbers)
        else:
            row(label, numbers, f"<= {most}x", ratio <= most)


def one_file(scratch: Path, runs: int, letter: str = "a") -> None:
    """Time the pyz, run by the system's Python, against the installed command."""
    section(f"({letter}) One file: lockrun.pyz against the installed lockrun")
    pyz = scratch / "lockrun.pyz"
    quiet(sys.executable, str(ROOT / "scripts" / "build-pyz"), "--out", str(pyz))
    files = f"file://{scratch}/locks"
    cases = {
        "installed --version": lambda: quiet(LOCKRUN, "--version"),
        "pyz --version": lambda: quiet(SYSTEM_PYTHON, str(pyz), "--version"),
        "installed run of true": lambda: quiet(LOCKRUN, "-u", files, "-n", "p", "--", "true"),
        "pyz run of true": lambda: quiet(
            SYSTEM_PYTHON, str(pyz), "-u", files, "-n", "p", "--", "true"
        ),
    }
    found = medians(cases, runs)
    report({label: found[label] for label in list(found)[:2]}, "installed --version")
    report({label: found[label] for label in list(found)[2:]}, "installed run of true")


def section_cases(uri: str, *acquire: str) -> dict[str, Callable[[], object]]:
    """Return a run of ``true`` and an acquire-release pair on *uri*, each on a fresh name."""

    def run() -> None:
        quiet(LOCKRUN, "-u", uri, "-n", fresh(), "--", "true")

    def pair() -> None:
        token = quiet(LOCKRUN, "acquire", "-u", uri, *acquire, fresh()).strip()
        quiet(LOCKRUN, "release", "-u", uri, token)

    return {"run of true": run, "acquire + release": pair}


def fresh() -> str:
    return f"bench-{uuid.uuid4().hex[:12]}"


def sections(scratch: Path, runs: int) -> None:
    """Time a section of a script under each backend, against a run and flock(1)."""
    section("(b) A locked section: acquire + release, against a run and flock(1)")
    lock = scratch / "section.lock"
    flock_form = f"exec 9>{lock}; flock 9; true; flock -u 9"
    for backend, uri, extra in (
        ("file:", f"file://{scratch}/locks", ()),
        ("abstract:", f"abstract:bench-{uuid.uuid4().hex[:8]}", ()),
        ("redis, keeper", REDIS, ()),
        ("redis, --no-keeper", REDIS, ("--no-keeper", "--ttl", "1m")),
    ):
        cases = {f"{backend} {label}": case for label, case in section_cases(uri, *extra).items()}
        if backend == "file:":
            cases["flock(1) fd form, sh"] = lambda: quiet("sh", "-c", flock_form)
        report(medians(cases, runs), f"{backend} run of true")


def monitoring(scratch: Path, runs: int, letter: str = "c") -> None:
    """Time a hook and the metrics file against the plain run."""
    section(f"({letter}) Monitoring: a hook and the metrics file, against the plain run")
    uri = f"file://{scratch}/locks"
    metrics = scratch / "lockrun.prom"

    def run(*extra: str) -> Callable[[], object]:
        return lambda: quiet(LOCKRUN, "-u", uri, "-n", "m", *extra, "--", "true")

    cases = {
        "plain run": run(),
        "--on-start true": run("--on-start", "true"),
        "--on-exit true": run("--on-exit", "true"),
        "--metrics-file": run("--metrics-file", str(metrics)),
    }
    report(medians(cases, runs), "plain run")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the three sections; 1 if a measurement broke."""
    parser = argparse.ArgumentParser(prog="python -m bench.reach", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer runs (a smoke test)")
    runs = QUICK_RUNS if parser.parse_args(argv).quick else RUNS
    print(f"lockrun reach bench: {runs} runs per case; load {load_average()}")
    print(f"bytecode {compile_bytecode()}")
    scratch = Path(tempfile.mkdtemp(prefix="lr-reach-"))
    try:
        one_file(scratch, runs)
        sections(scratch, runs)
        monitoring(scratch, runs)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"broken: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nload at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
