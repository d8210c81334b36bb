"""Run lockrun as the tests do, and read back what it reports.

Plain functions and classes, imported by test modules and fixtures alike; the fixtures that
wrap them live in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, Final

import click
import pytest

from lockrun.cli import _exit_status, dispatch
from lockrun.cli.output import say
from lockrun.errors import ExitCode, LockBusy
from lockrun.lock import DEFAULT_NAMESPACE, Lock
from lockrun.runner import states_for_status

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

LOCKRUN = (sys.executable, "-m", "lockrun")
# Leases short enough that a killed holder frees its slot within a test's patience.
TEST_TTL = "5"


def unmeasured() -> dict[str, str]:
    """Return our environment without coverage's subprocess hook, for stress loops.

    Hundreds of traced interpreter start-ups add minutes and no coverage.
    """
    return {key: value for key, value in os.environ.items() if not key.startswith("COVERAGE_")}


def lockrun(*args: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lockrun ARGS`` to completion and capture its output."""
    return subprocess.run(
        [*LOCKRUN, *args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


_FORKS: Final = [0]  # how many times this process forked: refused_in_process must not
os.register_at_fork(after_in_parent=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


def refused_in_process(
    capfd: pytest.CaptureFixture[str], *args: str
) -> subprocess.CompletedProcess[str]:
    """Run ``lockrun ARGS`` in this process, as `lockrun` does past its start-up; capture it.

    For arguments lockrun refuses before it holds or starts anything (a usage error, a bad
    URI, a server that cannot be reached): what `main` does but exit, so a sweep of them
    costs no interpreter start-up each. Not for a run that gets as far as a fork (a keeper,
    a guardian: a copy of the test's process): that fails the test.
    """
    forks = _FORKS[0]
    capfd.readouterr()
    try:
        command, prog, rest = dispatch(list(args))
    except click.UsageError as refusal:  # main's own refusal, before any command
        say(refusal.format_message())
        status: int = ExitCode.USAGE
    else:
        status = _exit_status(command, prog, rest)
    said = capfd.readouterr()
    assert _FORKS[0] == forks, f"lockrun {shlex.join(args)} forked: run it as a process"
    return subprocess.CompletedProcess([*LOCKRUN, *args], status, said.out, said.err)


def help_options(*subcommand: str) -> dict[str, bool]:
    """Map each ``-x``/``--long`` of ``lockrun [SUBCOMMAND] --help`` to whether it takes a value."""
    result = lockrun(*subcommand, "--help")
    assert result.returncode == 0, result.stderr
    options: dict[str, bool] = {}
    # An option's line starts with two spaces and a dash; its help follows two more spaces.
    for column in re.findall(r"^  (-\S.*?)(?: {2}|$)", result.stdout, flags=re.MULTILINE):
        takes_value = re.search(r" [A-Z]", column) is not None
        options.update(dict.fromkeys(re.findall(r"--?\w[\w-]*", column), takes_value))
    assert {"-h", "--help"} <= options.keys(), result.stdout  # the parse found the column
    return options


def start(*args: str, under: Sequence[str] = (), **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``python -m lockrun ARGS`` (run by the command *under*) in the background.

    Its stderr is captured.
    """
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([*under, *LOCKRUN, *args], text=True, **kwargs)


def finish(process: subprocess.Popen[str], timeout: float = 30) -> int:
    """Wait for a `start`ed process, drain its pipes, and return its status."""
    process.communicate(timeout=timeout)
    return process.returncode


def wait_for(condition: Callable[[], object], timeout: float = 15.0, what: str = "") -> None:
    """Poll *condition* until it is true; fail the test after *timeout* seconds.

    Every 10 ms at first, then less often, up to every 50 ms: many conditions ask a server
    (a PostgreSQL connection is a process forked on the server), and a fixed 10 ms kept a
    CPU busy for each test that waited seconds beside the others.
    """
    deadline = time.monotonic() + timeout
    pause = 0.01
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)


def hung(pid: int) -> str:
    """Describe *pid* and its descendants as the kernel sees them: for a hang's report.

    State, wait channel and system call of each, with its command line: where a lockrun
    that did not exit was stuck (a rare hang after a forwarded signal is being chased).
    """
    lines = []
    queue = [pid]
    while queue:
        each = queue.pop(0)
        try:
            with open(f"/proc/{each}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0].decode()
            parts = [
                open(f"/proc/{each}/{field}", "rb").read().decode(errors="replace").strip()  # noqa: SIM115
                for field in ("wchan", "syscall")
            ]
            argv = open(f"/proc/{each}/cmdline", "rb").read().replace(b"\0", b" ")  # noqa: SIM115
            children = open(f"/proc/{each}/task/{each}/children").read().split()  # noqa: SIM115
        except OSError:
            continue
        lines.append(f"{each} {state} wchan={parts[0]} syscall={parts[1]} {argv.decode()[:120]}")
        queue.extend(int(child) for child in children)
    return "\n".join(lines)


def one_line(stderr: str) -> str:
    """Assert *stderr* is exactly one ``lockrun: …`` line (no traceback) and return it."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("lockrun: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def gone(pid: int) -> bool:
    """Return whether *pid* has ended (a zombie awaiting its new parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in {b"Z", b"X"}
    except FileNotFoundError:
        return True


def states(uri: str, name: str) -> list[dict[str, Any]]:
    """Return what `lockrun status --json NAME` prints, asked in this process.

    Tests poll it in loops, and a `lockrun status` process per poll kept a core busy with
    interpreter start-ups beside the processes under test; the command's own output has
    tests of its own (test_cli.py, the servers' *_cli.py).
    """
    found = states_for_status(uri, DEFAULT_NAMESPACE, name)
    shown = json.loads(json.dumps([state.to_dict() for state in found]))  # as printed
    assert isinstance(shown, list)
    return shown


def queue_length(uri: str, name: str) -> int:
    """Return how many waiters `lockrun status` reports for *name*."""
    return sum(len(state["waiters"]) for state in states(uri, name))


def lock_state(uri: str, name: str) -> dict[str, Any]:
    """Return `lockrun status --json NAME`'s one entry."""
    (state,) = states(uri, name)
    return state


def waiter_pids(uri: str, name: str) -> list[int]:
    """Return the lockrun pids `status` lists as waiting for *name*, in queue order."""
    return [int(waiter["pid"]) for waiter in lock_state(uri, name)["waiters"]]


def holder_pids(uri: str, name: str) -> list[int]:
    """Return the lockrun pids `status` lists as holding *name*."""
    return [int(holder["pid"]) for holder in lock_state(uri, name)["holders"]]


class Held:
    """A lockrun process whose command holds the lock until `finish` is called."""

    def __init__(self, directory: Path, *options: str) -> None:
        """Start ``lockrun OPTIONS -- sh …`` and wait until its command runs."""
        tag = uuid.uuid4().hex[:8]
        self.ready = directory / f"ready-{tag}"
        self.go = directory / f"go-{tag}"
        # Polled every 50 ms: each poll is a `sleep` process, and at every 10 ms the
        # suite's waiting holders kept a sixth of the CPUs busy forking them.
        script = (
            f'echo "$LOCKRUN_SLOT $LOCKRUN_FENCE" > {self.ready}.tmp; mv {self.ready}.tmp'
            f" {self.ready}; while [ ! -e {self.go} ]; do sleep 0.05; done"
        )
        self.process = start(*options, "--", "sh", "-c", script)
        wait_for(lambda: self.ready.exists() or self.process.poll() is not None, what="holder")
        if not self.ready.exists():
            _, err = self.process.communicate()
            pytest.fail(f"holder did not start (status {self.process.returncode}): {err}")
        slot, *fence = self.ready.read_text().split()  # a shared holder has no fence
        self.slot = int(slot)
        self.fence = int(fence[0]) if fence else 0  # fences are above 0: 0 is none

    def finish(self) -> int:
        """Let the command end and return lockrun's status."""
        self.go.touch()
        self.process.communicate(timeout=30)
        return self.process.returncode


# Holds its slot until SLOTS run at once (or 2 s passed), then logs [start, end, slot].
INTERVAL = """
import os, pathlib, sys, time
start = time.monotonic_ns()
active = pathlib.Path(sys.argv[2], str(os.getpid()))
active.touch()
deadline = time.monotonic() + 2  # hold until N run at once, if the lock allows it
while len(list(active.parent.iterdir())) < int(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.005)
time.sleep(0.02)
active.unlink()
end = time.monotonic_ns()
with open(sys.argv[1], "a") as log:
    log.write(f"{start} {end} {os.environ['LOCKRUN_SLOT']}\\n")
"""


def interval_log(
    tmp_path: Path, options: Sequence[str], *, slots: int, rounds: int, workers: int = 8
) -> tuple[int, set[int], int]:
    """Run *workers* loops of *rounds* semaphore runs; return (runs, slots seen, most at once).

    Each run is ``lockrun OPTIONS -s SLOTS -w forever`` around a command that logs its
    interval.

    The oracle is the commands' own log, not lockrun's word.
    """
    log, active = tmp_path / "intervals", tmp_path / "active"
    active.mkdir()
    script = tmp_path / "interval.py"
    script.write_text(INTERVAL)
    lockrun_argv = shlex.join([*LOCKRUN, *options, "-s", str(slots), "-w", "forever", "--"])
    command = shlex.join([sys.executable, str(script), str(log), str(active), str(slots)])
    loop = f"for i in $(seq {rounds}); do {lockrun_argv} {command} || exit 1; done"
    started = [subprocess.Popen(["sh", "-c", loop], env=unmeasured()) for _ in range(workers)]
    assert [worker.wait(300) for worker in started] == [0] * workers
    events, seen = [], set()
    for line in log.read_text().splitlines():
        begin, end, slot = line.split()
        seen.add(int(slot))
        events += [(int(begin), 1), (int(end), -1)]
    running = peak = 0
    for _, change in sorted(events):  # at one instant an end comes before a start
        running += change
        peak = max(peak, running)
    return len(events) // 2, seen, peak


def python(code: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``python -c CODE`` (this interpreter) to completion and capture its output."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False,
        **kwargs,
    )  # fmt: skip


# A holder's lease in `take_over_ring`: renewed every 20 minutes, so one that hears a taker
# within the taker's 30 s wait heard its bell, whatever the machine's load.
RING_TTL: Final = 3600.0


def take_over_ring(uri: str, directory: Path, name: str, *options: str) -> float:
    """Return how long a holder of *options* took to hear a taker (its command's TERM).

    The holder renews every `RING_TTL`/3, long after the taker's `--wait` would end: the
    taker succeeding proves the bell rang. The time is for the record, not a budget.
    """
    ready, term = directory / f"ready-{name}", directory / f"term-{name}"
    script = (
        f"trap 'date +%s.%N > {term}; exit 0' TERM; touch {ready}; while :; do sleep 0.01; done"
    )
    ttl = ("--ttl", f"{RING_TTL:g}")
    holder = start("--uri", uri, "-n", name, *ttl, *options, "--", "sh", "-c", script)
    wait_for(ready.exists, what="the holder")
    asked = time.time()
    taker = lockrun("--uri", uri, "-n", name, "--take-over", "-w", "30", "--", "true")
    assert taker.returncode == 0, taker.stderr
    assert finish(holder) == 79
    return float(term.read_text()) - asked


def clean(result: subprocess.CompletedProcess[str], *statuses: int) -> None:
    """Assert a run ended with one of *statuses*, and with exactly one line if lockrun's."""
    assert result.returncode in statuses, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        one_line(result.stderr)


def statuses_read(uri: str, name: str) -> None:
    """Assert every form of status reads the lock: 0, no stderr, parseable JSON, no escapes."""
    for args in ([name], ["--json", name], ["--json"], []):
        shown = lockrun("status", "--uri", uri, *args)
        assert (shown.returncode, shown.stderr) == (0, ""), shown.stderr
        if "--json" in args:
            json.loads(shown.stdout)
        assert "\x1b" not in shown.stdout


def taken(uri: str, name: str) -> bool:
    """Whether *name* is taken now: a `Lock` of ours finds it busy (no lockrun's word)."""
    lock = Lock(name, uri=uri)
    try:
        with lock:
            return False
    except LockBusy:
        return True
    finally:
        lock.close()
