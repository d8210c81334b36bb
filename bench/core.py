"""What every measurement needs: the plan, targets, a scenario's processes, /proc, the output."""

from __future__ import annotations

import compileall
import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

from lockrun.uri import BACKENDS, SCHEMES
from tests.support.cli import states

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from subprocess import Popen

    from bench.servers import Server

NAME: Final = "bench"
FLOCK: Final = shutil.which("flock") or "/usr/bin/flock"
ETCD: Final = "etcd"  # the etcd backend, and the server `etcdctl lock` runs on
# The kind of `etcdctl lock`, the server backends' handoff peer: on the etcd group's own etcd,
# on a throwaway one beside the other server backends.
ETCDCTL_LOCK: Final = "etcdctl"
ETCDCTL: Final = shutil.which("etcdctl") or "/usr/bin/etcdctl"
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
SOCKET: Final = "-socket"  # a kind's suffix: the server backend reached over its unix socket
# The backends without a server, and those the bench starts a throwaway server for.
LOCAL: Final = tuple(
    b for b in BACKENDS if all(s.local for s in SCHEMES.values() if s.backend == b)
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
class ApiEffort:
    """How long the Python API is measured: cycles in one process, then processes contending."""

    rounds: int  # interleaved, each contender in a process of its own every round
    cycles: int  # timed in each round, after the warm-up
    warmup: int
    contend_rounds: int
    window: float  # seconds each contention round lasts


@dataclass(frozen=True)
class Plan:
    """How many repetitions one run makes; quick skips the unix sockets and the long FIFO."""

    efforts: dict[str, Effort]  # by backend
    fifo_waiters: int
    api: ApiEffort
    quick: bool


# By backend: the local ones, Redis, the SQL servers, etcd. A lockrun start with a server costs
# 3x one without; enough handoffs for a p99 in the full run. etcd's idle window covers a
# waiter's keep-alive and its read of the stop keys (every ttl/2, 15 s at the default ttl)
# in the full run: a window between two would show a waiter that costs nothing.
FULL: Final = Plan(
    dict.fromkeys(LOCAL, Effort(30, 20, 50, 5.0))
    | {"redis": Effort(30, 100, 200, 10.0)}
    | dict.fromkeys(("mysql", "postgres"), Effort(30, 100, 100, 10.0))
    | {ETCD: Effort(30, 100, 100, 16.0)},
    fifo_waiters=10,
    api=ApiEffort(rounds=5, cycles=200, warmup=20, contend_rounds=3, window=5.0),
    quick=False,
)
QUICK: Final = Plan(
    dict.fromkeys(LOCAL, Effort(15, 5, 8, 1.0))
    | {"redis": Effort(10, 5, 30, 2.0)}
    | dict.fromkeys(("mysql", "postgres"), Effort(5, 5, 15, 1.0))
    | {ETCD: Effort(5, 5, 15, 1.0)},
    fifo_waiters=4,
    api=ApiEffort(rounds=2, cycles=30, warmup=5, contend_rounds=1, window=1.0),
    quick=True,
)


@dataclass
class Bench:
    """What every measurement needs: the lockrun command, a scratch directory, the problems."""

    lockrun: list[str]
    root: Path
    plan: Plan
    problems: list[str] = field(default_factory=list)
    servers: dict[str, Server] = field(default_factory=dict)  # the running ones, by backend

    @classmethod
    @contextlib.contextmanager
    def running(cls, plan: Plan) -> Iterator[Bench]:
        """Give a bench whose directory goes at the end; TERM and HUP end it the same way."""
        for signo in (signal.SIGTERM, signal.SIGHUP):  # SystemExit: the finally blocks clean up
            signal.signal(signo, lambda signo, _: sys.exit(128 + signo))
        root = Path(tempfile.mkdtemp(prefix="lockrun-bench-"))
        script = Path(sys.executable).parent / "lockrun"  # else the module
        lockrun = [str(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "lockrun"]
        try:
            yield cls(lockrun, root, plan)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def scenario_dir(self, label: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.root))

    def broke(self, what: str, err: Broken) -> None:
        """Record and print a problem; the report goes on."""
        self.problems.append(f"{what}: {err}")
        row(what, "broke, see PROBLEMS below", "", "ERROR")

    def server_of(self, kind: str) -> Server | None:
        return self.servers.get(ETCD if kind == ETCDCTL_LOCK else kind.removesuffix(SOCKET))

    def target(self, kind: str, scenario: Path) -> Target:
        """Return a target of *kind* private to *scenario* (its own directory, prefix or name)."""
        directory = scenario / "locks"
        directory.mkdir(exist_ok=True)
        if (server := self.server_of(kind)) is not None:
            uri = server.socket_uri if kind.endswith(SOCKET) else server.uri
            uri = server.endpoint if kind == ETCDCTL_LOCK else uri
            return Target(self.lockrun, kind, directory, uri, f"{NAME}-{scenario.name}")
        if kind == "abstract":
            uri = f"abstract:bench{os.getpid()}-{scenario.name}"
            return Target(self.lockrun, kind, directory, uri)
        return Target(self.lockrun, kind, directory, f"file://{directory}")

    def start_holders(
        self, procs: Processes, target: Target, slots: int, poll: str, out: Path | None = None
    ) -> Path:
        """Start *slots* holders at once, wait until all run their commands; return GO."""
        go = procs.directory / "GO"
        procs.triggers.append(go)
        holders = []
        for index in range(slots):
            ready = procs.directory / f"READY{index}"
            script = [HOLD_SCRIPT, "sh", str(ready), str(go), str(procs.directory), poll]
            holders.append((ready, procs.spawn(target.argv("sh", "-c", *script, slots=slots), out)))
        poll_until(lambda: all(r.exists() or h.poll() is not None for r, h in holders), 10, 0.002)
        for ready, holder in holders:
            if not ready.exists():
                msg = f"holder never ran its command: {command_line(holder)}"
                msg += f" ({procs.stderr_of(holder)})" if holder.poll() is not None else ""
                raise Broken(msg)
        return go

    def queued(self, target: Target, wanted: set[int]) -> set[int]:
        """Return which of *wanted* are queued for *target*'s lock right now."""
        if (server := self.server_of(target.kind)) is not None:
            return server.waiting(target, wanted) & wanted
        if target.kind == "abstract":  # what `lockrun status` lists, asked in this process
            found = states(target.uri, target.name)
            return {int(waiter["pid"]) for state in found for waiter in state["waiters"]} & wanted
        return flock_pids(target.directory) & wanted

    def wait_queued(
        self, procs: Processes, target: Target, waiters: Sequence[Popen[bytes]], timeout: float = 10
    ) -> None:
        """Return once all *waiters* are queued for the lock (blocked, or head of a gate)."""
        wanted = {proc.pid for proc in waiters}
        server = self.server_of(target.kind)
        # How long between two looks: /proc/locks is cheap to read, a server's answer less so.
        pause = 0.002 if server is None else server.pauses[len(wanted) > 1]

        def done() -> bool:
            exited = any(proc.poll() is not None for proc in waiters)
            return exited or len(self.queued(target, wanted)) == len(wanted)

        # Seen all at once is enough: a Redis waiter leaves BLPOP for a moment when it re-asks.
        seen = poll_until(done, timeout, pause)
        for early in (proc for proc in waiters if proc.poll() is not None):
            msg = f"waiter exited {early.returncode} before it was granted: {command_line(early)}"
            raise Broken(f"{msg} ({procs.stderr_of(early)})")
        if not seen:
            found = len(self.queued(target, wanted))
            raise Broken(f"{found} of {len(wanted)} waiters queued after {timeout:.0f}s")
        if target.kind == "abstract":
            time.sleep(ABSTRACT_SETTLE)

    def version(self) -> str:
        command = [*self.lockrun, "--version"]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    def finish(self, began: float) -> int:
        """Say how long the run took, print the problems, if any; return the exit status."""
        print(f"\nfinished in {time.monotonic() - began:.1f} s; load {load_average()}")
        if self.problems:
            print("\nPROBLEMS (lockrun or the bench broke; reproduce with the command shown)")
            print("\n".join(f"  - {problem}" for problem in self.problems))
        return 1 if self.problems else 0


@dataclass(frozen=True)
class Target:
    """Where a scenario locks: its kind (a backend, one + SOCKET, flock or etcdctl), URI, name."""

    lockrun: list[str]
    kind: str
    directory: Path
    uri: str
    name: str = NAME

    def argv(
        self, *command: str, slots: int = 1, wait: bool = False, options: Sequence[str] = ()
    ) -> list[str]:
        """Return the command line that runs *command* under this target's lock.

        *options* go to lockrun before the command (a mode, a lease); flock(1) and etcdctl
        take none.
        """
        if self.kind == "flock":
            return [FLOCK, str(self.directory / "x"), *command]
        if self.kind == ETCDCTL_LOCK:
            lock = [ETCDCTL, f"--endpoints={self.uri}", "lock", self.name, "--", *command]
            return ["env", "ETCDCTL_API=3", *lock]
        where = ["--uri", self.uri, "-n", self.name]
        where += ["--slots", str(slots)] if slots > 1 else []
        where += ["--wait", "forever"] if wait else []
        return [*self.lockrun, *where, *options, "--", *command]


class Processes(contextlib.AbstractContextManager["Processes"]):
    """The processes of one scenario; leaving the block releases, stops and reaps them all."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory  # their stderr files and the GO triggers
        self.started: list[Popen[bytes]] = []
        self.triggers: list[Path] = []

    def spawn(self, argv: Sequence[str], stdout: Path | None = None) -> Popen[bytes]:
        """Start *argv* in its own session, stdout to *stdout*, stderr to a file."""
        errors = self.directory / f"{len(self.started)}.err"
        with open(stdout or os.devnull, "wb") as out, errors.open("wb") as err:
            devnull = subprocess.DEVNULL
            proc = subprocess.Popen(
                argv, stdin=devnull, stdout=out, stderr=err, start_new_session=True
            )
        self.started.append(proc)
        return proc

    def stderr_of(self, proc: Popen[bytes]) -> str:
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
                raise Broken(f"exit {status} from {command_line(proc)}: {self.stderr_of(proc)}")

    def __exit__(self, *_: object) -> None:
        """Release the holders, then TERM and at last KILL every process left, and reap."""
        for trigger in self.triggers:
            with contextlib.suppress(OSError):
                trigger.touch()
        live = [proc for proc in self.started if proc.poll() is None]
        family = descendants({proc.pid for proc in live}) if live else set()
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


def command_line(proc: Popen[bytes]) -> str:
    """Return *proc*'s command line as a shell would take it, to reproduce a problem."""
    return shlex.join(cast("list[str]", proc.args))


def stat_fields(where: Path) -> list[str]:
    """Return /proc/PID/stat's fields from the state on (field 3 of proc(5) is index 0)."""
    text = (where / "stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def descendants(pids: set[int]) -> set[int]:
    """Return every live descendant of *pids*, found through the ppid of /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(int(stat_fields(Path("/proc", entry))[1]), []).append(int(entry))
    found: set[int] = set()
    todo = list(pids)
    while todo:
        for child in set(children.get(todo.pop(), [])) - found:
            found.add(child)
            todo.append(child)
    return found


@dataclass(frozen=True)
class Usage:
    """A process's counters at one moment, or what it spent between two moments."""

    cpu: float  # user + system, in clock ticks: what short-lived children used may round to 0
    run: float  # on a CPU, to the ns (schedstat)
    switches: int  # how often it was switched out: its wake-ups, roughly

    @classmethod
    def of(cls, pid: int, task: int | None = None) -> Usage:
        """Sample *pid* (or its thread *task*) now."""
        where = Path(f"/proc/{pid}" if task is None else f"/proc/{pid}/task/{task}")
        fields = stat_fields(where)
        status = (where / "status").read_text().splitlines()
        switches = sum(int(line.split()[-1]) for line in status if "ctxt_switches:" in line)
        run = int((where / "schedstat").read_text().split()[0]) / 1e9
        return cls((int(fields[11]) + int(fields[12])) / CLOCK_TICKS, run, switches)

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.cpu + other.cpu, self.run + other.run, self.switches + other.switches)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu - other.cpu, self.run - other.run, self.switches - other.switches)


def family_usage(pids: Iterable[int]) -> dict[int, Usage]:
    """Sample *pids*, which must be alive, and their children (a guardian), which may go."""
    usage = {pid: Usage.of(pid) for pid in pids}
    for child in descendants(set(usage)):
        with contextlib.suppress(OSError, ValueError, IndexError):
            usage[child] = Usage.of(child)
    return usage


def pss(pids: Iterable[int]) -> float:
    """Return the proportional set size of *pids* together, in MiB (/proc/PID/smaps_rollup).

    A page shared by k processes counts 1/k for each: the memory each costs the machine.
    """
    total = 0  # kB
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            total += sum(int(line.split()[1]) for line in lines if line.startswith("Pss:"))
    return total / 1024


def spent(before: dict[int, Usage], after: dict[int, Usage]) -> Usage:
    """Return what the processes of *after* spent since *before* (a newcomer: all it used)."""
    nothing = Usage(0.0, 0.0, 0)
    return sum((late - before.get(pid, nothing) for pid, late in after.items()), nothing)


def flock_pids(directory: Path) -> set[int]:
    """Return the pids holding or waiting for a flock on a file in *directory* (/proc/locks)."""
    files = (entry.stat() for entry in directory.iterdir())
    inodes = {(info.st_dev, info.st_ino) for info in files if not stat.S_ISDIR(info.st_mode)}
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


def poll_until(condition: Callable[[], bool], timeout: float, pause: float) -> bool:
    """Check *condition* every *pause* seconds until it holds (True) or *timeout* (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
    return True


def row(what: str, numbers: str, target: str = "", verdict: bool | str = "") -> None:
    """Print one report line: what, the numbers, the target and PASS/MISS (met or not)."""
    verdict = ("PASS" if verdict else "MISS") if isinstance(verdict, bool) else verdict
    print(f"  {what:<36} {numbers:<44} {target:<10} {verdict}".rstrip())


def ratio_row(what: str, ratio: float, most: float | None = None) -> None:
    """Print a ratio, with its verdict when it has a target: at most *most*."""
    if most is None:
        row(what, f"{ratio:5.2f}x")
    else:
        row(what, f"{ratio:5.2f}x", f"<= {most}x", ratio <= most)


def section(title: str) -> None:
    print(f"\n{title}\n{'-' * len(title)}")


def percentile(values: Sequence[float], percent: int) -> float:
    """Return the *percent*-th percentile of *values* (inclusive method)."""
    if len(values) < 2:  # quantiles needs two points
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1]


def describe(values: Sequence[float], tail: bool = True) -> str:
    """Return the median and the 99th percentile (or the max) of *values* (ms) as text."""
    last = f"p99 {percentile(values, 99):6.2f}" if tail else f"max {max(values):6.2f}"
    return f"median {statistics.median(values):6.2f} ms  {last} ms  n={len(values)}"


def idle_row(what: str, usage: Usage, window: float, alone: Usage | None = None) -> None:
    """Print CPU used over the idle window against the target (1 % of one CPU).

    A server's is judged above what it spent *alone* (with no client, measured just
    before): the waiters' cost, not the server's own ticks (etcd's raft alone is ~1 %).
    """
    # The verdict takes the larger of the two figures: ticks miss what many short-lived
    # processes used below a tick each, the exact run time misses processes that ended.
    numbers = f"{usage.cpu:5.3f} s CPU ({usage.run * 1000:.1f} ms exact), {usage.switches} wakeups"
    judged = usage if alone is None else usage - alone
    if alone is not None:
        numbers += f"; {max(judged.run, 0.0) * 1000:.1f} ms above alone"
    target = window * IDLE_CPU_SHARE
    # At most: a tick's worth that equals the target is within it, whatever the float sums.
    row(what, numbers, f"<= {target:.2g} s", round(max(judged.cpu, judged.run), 6) <= target)


def compile_bytecode() -> str:
    """Compile lockrun's bytecode, as `pip install` does; say where it went."""
    # An editable install under PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every
    # module on every start, a cost no installed lockrun pays.
    spec = importlib.util.find_spec("lockrun")
    if spec is None or spec.submodule_search_locations is None:
        return "lockrun not importable here: bytecode not compiled"
    package = next(iter(spec.submodule_search_locations))
    compileall.compile_dir(package, quiet=1)
    return f"compiled in {package}"


def load_average() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())
