"""What every measurement needs: the plan, targets, the processes of a scenario, /proc, output."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn, Self

from lockrun.uri import BACKENDS, SCHEMES

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from types import FrameType, TracebackType

    from bench.servers import Server

NAME: Final = "bench"
FLOCK: Final = shutil.which("flock") or "/usr/bin/flock"
CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
# A holder's command: say it runs, wait for GO (or the bench's directory to vanish), then
# print the time in ns as its last act; $1 READY, $2 GO, $3 directory, $4 poll interval.
HOLD_SCRIPT: Final = (
    ': > "$1"; while [ ! -e "$2" ]; do [ -d "$3" ] || exit 1; sleep "$4"; done; exec date +%s%N'
)
HANDOFF_POLL: Final = "0.005"
IDLE_POLL: Final = "0.1"
# "Idle waiters ≈ 0 CPU" (docs/design.md), made a number: all of them together use at most 1 %
# of one CPU over the window. Local waiters sleep in the kernel and use none; Redis waiters
# re-ask every ttl/2 to keep their place in the queue, which is what frees a dead one's.
IDLE_CPU_SHARE: Final = 0.01
ABSTRACT_SETTLE: Final = 0.05  # status lists a waiter just before it connects
STOP_GRACE: Final = 3.0
WIDTH: Final = 100
SOCKET: Final = "-socket"  # a kind's suffix: the server backend reached over its unix socket
# The backends without a server, and those the bench starts a throwaway server for.
LOCAL: Final = tuple(
    backend
    for backend in BACKENDS
    if all(scheme.local for scheme in SCHEMES.values() if scheme.backend == backend)
)
SERVED: Final = tuple(backend for backend in BACKENDS if backend not in LOCAL)


class Broken(Exception):
    """A failure rather than a slow result: a hang, a crash or an unexpected exit status."""


@dataclass(frozen=True)
class Effort:
    """How many repetitions the measurements of one backend make."""

    startup_runs: int
    handoff_trials: int
    idle_waiters: int  # with --slots 1 and with --slots 3
    idle_window: float  # seconds


@dataclass(frozen=True)
class Plan:
    """How many repetitions one run makes."""

    efforts: dict[str, Effort]  # by backend
    fifo_waiters: int
    long_fifo: bool  # also hold the lock LONG_HOLD seconds before releasing the FIFO queue
    socket: bool  # also time a server's handoffs through its unix socket, for reference


def efforts(local: Effort, redis: Effort, sql: Effort) -> dict[str, Effort]:
    """Return the efforts by backend: one for the local backends, Redis, the SQL servers."""
    return dict.fromkeys(LOCAL, local) | {"redis": redis, "mysql": sql, "postgres": sql}


# A lockrun start with a server costs 3x one without; enough handoffs for a p99 in the full run.
FULL: Final = Plan(
    efforts(Effort(30, 20, 50, 5.0), Effort(30, 100, 200, 10.0), Effort(30, 100, 100, 10.0)),
    fifo_waiters=10,
    long_fifo=True,
    socket=True,
)
QUICK: Final = Plan(
    efforts(Effort(15, 5, 8, 1.0), Effort(10, 5, 30, 2.0), Effort(5, 5, 15, 1.0)),
    fifo_waiters=4,
    long_fifo=False,
    socket=False,
)


@dataclass
class Bench:
    """What every measurement needs: the lockrun command, a scratch directory, the problems."""

    lockrun: list[str]
    root: Path
    plan: Plan
    problems: list[str] = field(default_factory=list)
    scenarios: int = 0
    servers: dict[str, Server] = field(default_factory=dict)  # the running ones, by backend

    def scenario_dir(self, label: str) -> Path:
        """Return a fresh directory for one scenario."""
        self.scenarios += 1
        directory = self.root / f"{self.scenarios:03d}-{label}"
        directory.mkdir()
        return directory

    def broke(self, what: str, err: Broken) -> None:
        """Record and print a problem; the report goes on."""
        self.problems.append(f"{what}: {err}")
        row(what, "broke, see PROBLEMS below", "", "ERROR")

    def server_of(self, kind: str) -> Server | None:
        """Return the server a target of *kind* locks on, None for a local backend."""
        backend = kind.removesuffix(SOCKET)
        if backend not in SERVED:
            return None
        if backend not in self.servers:
            msg = f"no {backend} server is running"
            raise Broken(msg)
        return self.servers[backend]


@dataclass(frozen=True)
class Target:
    """Where a scenario locks: its kind, its lock directory, lockrun URI and lock name.

    A kind is a backend, a server backend with SOCKET (its unix socket), or flock (flock(1)).
    """

    kind: str
    directory: Path
    uri: str
    name: str = NAME

    def argv(
        self, lockrun: Sequence[str], command: Sequence[str], *, slots: int = 1, wait: bool = False
    ) -> list[str]:
        """Return the command line that runs *command* under this target's lock."""
        if self.kind == "flock":
            return [FLOCK, str(self.directory / "x"), *command]
        options = ["--uri", self.uri, "-n", self.name]
        if slots > 1:
            options += ["--slots", str(slots)]
        if wait:
            options += ["--wait", "forever"]
        return [*lockrun, *options, "--", *command]


def make_target(bench: Bench, kind: str, scenario: Path) -> Target:
    """Return a target of *kind* private to *scenario* (its own directory, prefix or name)."""
    directory = scenario / "locks"
    directory.mkdir(exist_ok=True)
    server = bench.server_of(kind)
    if server is not None:
        uri = server.socket_uri if kind.endswith(SOCKET) else server.uri
        return Target(kind, directory, uri, f"{NAME}-{scenario.name}")
    if kind == "abstract":
        return Target(kind, directory, f"abstract:bench{os.getpid()}-{scenario.name}")
    return Target(kind, directory, f"file://{directory}")


class Processes:
    """The processes of one scenario; leaving the block releases, stops and reaps them all."""

    def __init__(self, directory: Path) -> None:
        """Keep stderr files and GO triggers in *directory*."""
        self.directory = directory
        self.started: list[subprocess.Popen[bytes]] = []
        self.triggers: list[Path] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def spawn(self, argv: Sequence[str], stdout: Path | None = None) -> subprocess.Popen[bytes]:
        """Start *argv* in its own session, stdout to *stdout*, stderr to a file."""
        errors = self.directory / f"{len(self.started)}.err"
        with open(stdout or os.devnull, "wb") as out, errors.open("wb") as err:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
        self.started.append(proc)
        return proc

    def stderr_of(self, proc: subprocess.Popen[bytes]) -> str:
        """Return what *proc* wrote to stderr, on one line."""
        path = self.directory / f"{self.started.index(proc)}.err"
        return " | ".join(path.read_text(errors="replace").split("\n")).strip(" |")

    def finish(self, timeout: float) -> None:
        """Wait for every process to exit with status 0; raise `Broken` otherwise."""
        deadline = time.monotonic() + timeout
        for proc in self.started:
            try:
                status = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                msg = f"still running after {timeout:.0f}s: {command_line(proc)}"
                raise Broken(msg) from None
            if status != 0:
                msg = f"exit {status} from {command_line(proc)}: {self.stderr_of(proc)}"
                raise Broken(msg)

    def stop(self) -> None:
        """Release the holders, then TERM and at last KILL every process left, and reap."""
        for trigger in self.triggers:
            with contextlib.suppress(OSError):
                trigger.touch()
        live = [proc for proc in self.started if proc.poll() is None]
        if not live:
            return
        family = descendants({proc.pid for proc in live})
        for proc in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for pid in family | {proc.pid for proc in live if proc.poll() is None}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for proc in live:
            proc.wait()


def command_line(proc: subprocess.Popen[bytes]) -> str:
    """Return *proc*'s command line as a shell would take it, to reproduce a problem."""
    args = proc.args
    if isinstance(args, str | bytes | os.PathLike):
        return os.fsdecode(args)
    return shlex.join(os.fsdecode(arg) for arg in args)


# -- /proc ---------------------------------------------------------------------------------


def stat_fields(pid: int) -> list[str]:
    """Return /proc/PID/stat's fields from the state on (field 3 of proc(5) is index 0)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def descendants(pids: set[int]) -> set[int]:
    """Return every live descendant of *pids*, found through the ppid of /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(int(stat_fields(int(entry))[1]), []).append(int(entry))
    found: set[int] = set()
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_seconds(pid: int, fields: slice = slice(11, 13)) -> float:
    """Return the user plus system CPU time *pid* has used, in seconds (clock ticks).

    *fields* 13 and 14 instead are what the children it reaped used.
    """
    return sum(int(value) for value in stat_fields(pid)[fields]) / CLOCK_TICKS


def proc_dir(pid: int, task: int | None = None) -> Path:
    """Return /proc/PID, or /proc/PID/task/TASK for one thread of it."""
    return Path(f"/proc/{pid}") if task is None else Path(f"/proc/{pid}/task/{task}")


def run_seconds(pid: int, task: int | None = None) -> float:
    """Return the time *pid*'s main thread (or *task*) spent on a CPU, to the ns (schedstat)."""
    return int((proc_dir(pid, task) / "schedstat").read_text().split()[0]) / 1e9


def context_switches(pid: int, task: int | None = None) -> int:
    """Return how often *pid* (or its thread *task*) was switched out: its wake-ups, roughly."""
    lines = (proc_dir(pid, task) / "status").read_text().splitlines()
    return sum(int(line.split()[-1]) for line in lines if "ctxt_switches:" in line)


@dataclass(frozen=True)
class Usage:
    """A process's counters at one moment, or what it spent between two moments."""

    cpu: float
    run: float
    switches: int

    @classmethod
    def of(cls, pid: int) -> Usage:
        """Sample *pid* now."""
        return cls(cpu_seconds(pid), run_seconds(pid), context_switches(pid))

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.cpu + other.cpu, self.run + other.run, self.switches + other.switches)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu - other.cpu, self.run - other.run, self.switches - other.switches)


NOTHING: Final = Usage(0.0, 0.0, 0)


def family_usage(pids: Iterable[int]) -> dict[int, Usage]:
    """Sample *pids*, which must be alive, and their children (a guardian), which may go."""
    usage = {pid: Usage.of(pid) for pid in pids}
    for child in descendants(set(usage)):
        with contextlib.suppress(OSError, ValueError, IndexError):
            usage[child] = Usage.of(child)
    return usage


def spent(before: dict[int, Usage], after: dict[int, Usage]) -> Usage:
    """Return what the processes of *after* spent since *before* (a newcomer: all it used)."""
    total = NOTHING
    for pid, late in after.items():
        total += late - before.get(pid, NOTHING)
    return total


def flock_pids(directory: Path) -> set[int]:
    """Return the pids holding or waiting for a flock on a file in *directory* (/proc/locks)."""
    inodes = {
        (info.st_dev, info.st_ino)
        for info in (entry.stat() for entry in directory.iterdir())
        if not stat.S_ISDIR(info.st_mode)
    }
    pids = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        fields = fields[2:] if fields[1:2] == ["->"] else fields[1:]
        if len(fields) < 5 or fields[0] != "FLOCK":
            continue
        major, minor, inode = fields[4].split(":")
        if (os.makedev(int(major, 16), int(minor, 16)), int(inode)) in inodes:
            pids.add(int(fields[3]))
    return pids


# -- queues --------------------------------------------------------------------------------


def queued_pids(bench: Bench, target: Target, wanted: set[int]) -> set[int]:
    """Return which of *wanted* are queued for *target*'s lock right now."""
    server = bench.server_of(target.kind)
    if server is not None:
        return server.waiting(target.name, wanted) & wanted
    if target.kind == "abstract":
        out = subprocess.run(
            [*bench.lockrun, "status", "--uri", target.uri, "--json", target.name],
            capture_output=True,
            check=False,
            text=True,
        )
        if out.returncode != 0:
            msg = f"exit {out.returncode} from lockrun status --uri {target.uri}: {out.stderr}"
            raise Broken(msg.strip())
        waiters = (waiter for state in json.loads(out.stdout) for waiter in state["waiters"])
        return {int(waiter["pid"]) for waiter in waiters} & wanted
    return flock_pids(target.directory) & wanted


def queue_pause(bench: Bench, kind: str, waiters: int) -> float:
    """Return how long to pause between two looks at the queue of *waiters* of *kind*."""
    server = bench.server_of(kind)
    if server is not None:
        return server.pauses[waiters > 1]
    if kind == "abstract":  # `lockrun status` costs a process start
        return 0.02 if waiters == 1 else 0.25
    return 0.002  # /proc/locks is cheap to read


def wait_queued(
    bench: Bench,
    procs: Processes,
    target: Target,
    waiters: Sequence[subprocess.Popen[bytes]],
    timeout: float = 10.0,
) -> None:
    """Return once every one of *waiters* is queued for the lock (blocked, or head of a gate)."""
    wanted = {proc.pid for proc in waiters}
    pause = queue_pause(bench, target.kind, len(wanted))

    def done() -> bool:
        if any(proc.poll() is not None for proc in waiters):
            return True
        return len(queued_pids(bench, target, wanted)) == len(wanted)

    # Seen all at once is enough: a Redis waiter leaves BLPOP for a moment when it re-asks.
    seen = poll_until(done, timeout, pause)
    exited = [proc for proc in waiters if proc.poll() is not None]
    if exited:
        early = exited[0]
        msg = f"waiter exited {early.returncode} before it was granted: {command_line(early)}"
        raise Broken(f"{msg} ({procs.stderr_of(early)})")
    if not seen:
        found = len(queued_pids(bench, target, wanted))
        msg = f"{found} of {len(wanted)} waiters queued after {timeout:.0f}s"
        raise Broken(msg)
    if target.kind == "abstract":
        time.sleep(ABSTRACT_SETTLE)


def poll_until(condition: Callable[[], bool], timeout: float, pause: float) -> bool:
    """Check *condition* every *pause* seconds until it holds (True) or *timeout* (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
    return True


def start_holders(
    bench: Bench,
    procs: Processes,
    target: Target,
    slots: int,
    poll: str,
    stdout: Path | None = None,
) -> Path:
    """Start *slots* holders at once, wait until all run their commands; return GO."""
    scenario = procs.directory
    go = scenario / "GO"
    procs.triggers.append(go)
    holders = []
    for index in range(slots):
        ready = scenario / f"READY{index}"
        command = ["sh", "-c", HOLD_SCRIPT, "sh", str(ready), str(go), str(scenario), poll]
        holder = procs.spawn(target.argv(bench.lockrun, command, slots=slots), stdout=stdout)
        holders.append((ready, holder))
    poll_until(lambda: all(started(ready, holder) for ready, holder in holders), 10.0, 0.002)
    for ready, holder in holders:
        if not ready.exists():
            msg = f"holder never ran its command: {command_line(holder)}"
            msg += f" ({procs.stderr_of(holder)})" if holder.poll() is not None else ""
            raise Broken(msg)
    return go


def started(ready: Path, holder: subprocess.Popen[bytes]) -> bool:
    """Tell whether *holder* has run its command (made *ready*) or died trying."""
    return ready.exists() or holder.poll() is not None


# -- output --------------------------------------------------------------------------------


def row(what: str, numbers: str, target: str = "", verdict: str = "") -> None:
    """Print one report line: what, the numbers, the target and PASS/MISS."""
    print(f"  {what:<36} {numbers:<44} {target:<10} {verdict}".rstrip())


def verdict(ok: bool) -> str:
    """Return PASS or MISS."""
    return "PASS" if ok else "MISS"


def section(title: str) -> None:
    """Print a section heading."""
    print(f"\n{title}\n{'-' * len(title)}")


def percentile(values: Sequence[float], percent: int) -> float:
    """Return the *percent*-th percentile of *values* (inclusive method)."""
    if len(values) < 2:  # quantiles needs two points
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1]


def describe_ms(values: Sequence[float]) -> str:
    """Return median and max of *values* (milliseconds) as text."""
    return f"median {statistics.median(values):6.2f} ms  max {max(values):6.2f} ms  n={len(values)}"


def describe_tail(values: Sequence[float]) -> str:
    """Return median and 99th percentile of *values* (milliseconds) as text."""
    median, p99 = statistics.median(values), percentile(values, 99)
    return f"median {median:6.2f} ms  p99 {p99:6.2f} ms  n={len(values)}"


def idle_row(what: str, usage: Usage, window: float) -> None:
    """Print CPU used over the idle window against the target (1 % of one CPU).

    The verdict takes the larger of the two figures: ticks miss what many short-lived
    processes used below a tick each, the exact run time misses processes that ended.
    """
    numbers = f"{usage.cpu:5.3f} s CPU ({usage.run * 1000:.1f} ms exact), {usage.switches} wakeups"
    target = window * IDLE_CPU_SHARE
    row(what, numbers, f"<= {target:.2g} s", verdict(max(usage.cpu, usage.run) <= target))


# -- running -------------------------------------------------------------------------------


def find_lockrun() -> list[str]:
    """Return the lockrun command next to this interpreter, else ``python -m lockrun``."""
    script = Path(sys.executable).parent / "lockrun"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "lockrun"]


def lockrun_version(bench: Bench) -> str:
    """Return what `lockrun --version` prints."""
    return subprocess.run(
        [*bench.lockrun, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def compile_bytecode() -> str:
    """Compile lockrun's bytecode, as `pip install` does; say where it went.

    An editable install under PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every
    module on every start, a cost no installed lockrun pays.
    """
    import compileall  # noqa: PLC0415 - only the bench needs it
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("lockrun")
    if spec is None or spec.submodule_search_locations is None:
        return "lockrun not importable here: bytecode not compiled"
    package = next(iter(spec.submodule_search_locations))
    compileall.compile_dir(package, quiet=1)
    return f"compiled in {package}"


def load_average() -> str:
    """Return the 1, 5 and 15 minute load averages as text."""
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def machine() -> str:
    """Return the kernel, architecture and CPUs."""
    return f"{platform.release()} on {platform.machine()}, {os.cpu_count()} CPUs"


def problems(bench: Bench) -> int:
    """Print the problems, if any; return the exit status."""
    if not bench.problems:
        return 0
    print("\nPROBLEMS (lockrun or the bench broke; reproduce with the command shown)")
    for problem in bench.problems:
        print(f"  - {problem}")
    return 1


def stop_on_term(signo: int, _frame: FrameType | None) -> NoReturn:
    """Turn TERM and HUP into SystemExit, so the finally blocks stop what we started."""
    raise SystemExit(128 + signo)


def catch_term() -> None:
    """Stop on TERM and HUP through SystemExit (see `stop_on_term`)."""
    for signo in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signo, stop_on_term)
