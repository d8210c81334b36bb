"""Benchmark lockrun: startup, handoff latency, idle waiters' CPU and FIFO order (SPEC §6).

Run it from the repository root as ``python bench/bench.py [--quick]``. It prints one
plain-text report measured in this one run; a missed target is a MISS line, not a failure.
The Redis sections run against a redis-server of the bench's own on a loopback TCP port,
the MySQL sections against a throwaway mariadbd of its own (a fresh data directory, a
loopback TCP port and a unix socket), the PostgreSQL sections against a throwaway postgres
of its own (a fresh cluster in a temporary directory, a loopback TCP port and a unix
socket; never the machine's own server); each is skipped, with the reason, when its server
(or its driver) is not installed or does not start, and is stopped and removed at the end
whatever happens.
The exit status is 1 only when something broke (lockrun crashed, hung or exited with a
status it should not have); every such problem is listed at the end with its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import platform
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final, Literal, NoReturn, Protocol, Self

import pymysql

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from types import FrameType, TracebackType

    import psycopg  # imported where used: the postgres extra is optional

NAME: Final = "bench"
FLOCK: Final = shutil.which("flock") or "/usr/bin/flock"
CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
# A holder's command: say it runs, wait for GO (or the bench's directory to vanish), then
# print the time in ns as its last act; $1 READY, $2 GO, $3 directory, $4 poll interval.
HOLD_SCRIPT: Final = (
    ': > "$1"; while [ ! -e "$2" ]; do [ -d "$3" ] || exit 1; sleep "$4"; done; exec date +%s%N'
)
APPEND_SCRIPT: Final = 'echo "$1 ${LOCKRUN_FENCE:-}" >> "$2"'  # $1 index, $2 order file
STAMP: Final = ("date", "+%s%N")
HANDOFF_POLL: Final = "0.005"
IDLE_POLL: Final = "0.1"
# "Idle waiters ≈ 0 CPU" (SPEC §6), made a number: all of them together use at most 1 % of
# one CPU over the window. Local waiters sleep in the kernel and use none; Redis waiters
# re-ask every ttl/2 to keep their place in the queue, which is what frees a dead one's.
IDLE_CPU_SHARE: Final = 0.01
FIFO_SPACING: Final = 0.1
LONG_HOLD: Final = 6.0  # a wait of seconds, as in real use, not only a fresh queue
STARTUP_TARGET: Final = 1.3
FILE_HANDOFF_RATIO: Final = 2.0
OTHER_HANDOFF_MS: Final = 10.0
ABSTRACT_SETTLE: Final = 0.05  # status lists a waiter just before it connects
STOP_GRACE: Final = 3.0
WIDTH: Final = 100
REDIS_SERVER: Final = "redis-server"
REDIS_START: Final = 10.0  # seconds to answer PING
REDIS_PROBE: Final = 1  # the bench's own connection, counted in INFO clients
MARIADBD: Final = "mariadbd"
MARIADB_INSTALL: Final = "mariadb-install-db"
MYSQL_INSTALL: Final = 120.0  # seconds for mariadb-install-db (~1 s)
MYSQL_START: Final = 30.0  # seconds to accept a connection on its socket
MYSQL_PROBE: Final = 1  # the bench's own session, counted in Threads_connected
MYSQL_DATABASE: Final = "lockrun"
USER_LOCK: Final = "User lock"  # PROCESSLIST STATE of a session waiting inside GET_LOCK
# What a lockrun waiter puts after its GET_LOCK: who waits, with lockrun's pid.
WAITER_TAG: Final = re.compile(r"/\* lockrun (\{.*\}) \*/\s*\Z", re.DOTALL)
# The same before every PostgreSQL statement (pg_stat_activity keeps its first 1024 bytes);
# its JSON escapes every / and *, so the first */ ends it.
POSTGRES_TAG: Final = re.compile(r"/\* lockrun (\{[^*]*\}) \*/")
POSTGRES: Final = "postgres"
POSTGRES_BINARIES: Final = "/usr/lib/postgresql/*/bin"  # Debian keeps them off PATH
POSTGRES_ACCOUNT: Final = "postgres"  # initdb and postgres refuse to run as root
POSTGRES_INSTALL: Final = 120.0  # seconds for initdb (~1 s)
POSTGRES_START: Final = 30.0  # seconds to accept a connection on its socket
POSTGRES_STOP: Final = 10.0  # SIGQUIT: the postmaster kills a lingering backend after 5 s
POSTGRES_USER: Final = "lockrun"  # initdb's superuser, trusted on the socket and loopback
POSTGRES_DATABASE: Final = "lockrun"

Kind = Literal[
    "file", "abstract", "redis", "mysql", "mysql-socket", "postgres", "postgres-socket", "flock"
]
SCENARIOS: Final[tuple[tuple[Kind, int], ...]] = (
    ("file", 1),
    ("file", 3),
    ("abstract", 1),
    ("abstract", 3),
)
REDIS_SCENARIOS: Final[tuple[tuple[Kind, int], ...]] = (("redis", 1), ("redis", 3))
MYSQL_SCENARIOS: Final[tuple[tuple[Kind, int], ...]] = (("mysql", 1), ("mysql", 3))
MYSQL_KINDS: Final[frozenset[Kind]] = frozenset({"mysql", "mysql-socket"})
POSTGRES_SCENARIOS: Final[tuple[tuple[Kind, int], ...]] = (("postgres", 1), ("postgres", 3))
POSTGRES_KINDS: Final[frozenset[Kind]] = frozenset({"postgres", "postgres-socket"})


class Broken(Exception):
    """A failure rather than a slow result: a hang, a crash or an unexpected exit status."""


@dataclass(frozen=True)
class Plan:
    """How many repetitions one run makes."""

    startup_runs: int
    handoff_trials: int
    idle_waiters: int
    idle_window: float
    fifo_waiters: int
    long_fifo: bool  # also hold the lock LONG_HOLD seconds before releasing the FIFO queue
    redis_startup_runs: int  # a lockrun start with redis costs 3x one without
    redis_handoff_trials: int  # enough for a p99 in the full run
    redis_idle_waiters: int
    redis_idle_window: float
    mysql_startup_runs: int
    mysql_handoff_trials: int
    mysql_idle_waiters: int  # with --slots 1 and with --slots 3
    mysql_idle_window: float
    mysql_socket: bool  # also time handoffs through the unix socket, for reference
    postgres_startup_runs: int
    postgres_handoff_trials: int
    postgres_idle_waiters: int  # with --slots 1 and with --slots 3
    postgres_idle_window: float
    postgres_socket: bool  # also time handoffs through the unix socket, for reference


FULL: Final = Plan(
    startup_runs=30,
    handoff_trials=20,
    idle_waiters=50,
    idle_window=5.0,
    fifo_waiters=10,
    long_fifo=True,
    redis_startup_runs=30,
    redis_handoff_trials=100,
    redis_idle_waiters=200,
    redis_idle_window=10.0,
    mysql_startup_runs=30,
    mysql_handoff_trials=100,
    mysql_idle_waiters=100,
    mysql_idle_window=10.0,
    mysql_socket=True,
    postgres_startup_runs=30,
    postgres_handoff_trials=100,
    postgres_idle_waiters=100,
    postgres_idle_window=10.0,
    postgres_socket=True,
)
QUICK: Final = Plan(
    startup_runs=15,
    handoff_trials=5,
    idle_waiters=8,
    idle_window=1.0,
    fifo_waiters=4,
    long_fifo=False,
    redis_startup_runs=10,
    redis_handoff_trials=5,
    redis_idle_waiters=30,
    redis_idle_window=2.0,
    mysql_startup_runs=5,
    mysql_handoff_trials=5,
    mysql_idle_waiters=15,
    mysql_idle_window=1.0,
    mysql_socket=False,
    postgres_startup_runs=5,
    postgres_handoff_trials=5,
    postgres_idle_waiters=15,
    postgres_idle_window=1.0,
    postgres_socket=False,
)


@dataclass
class Bench:
    """What every section needs: the lockrun command, a scratch directory, the problems."""

    lockrun: list[str]
    root: Path
    plan: Plan
    problems: list[str] = field(default_factory=list)
    scenarios: int = 0
    redis: RedisServer | None = None  # set while the Redis sections run
    mysql: MariaServer | None = None  # set while the MySQL sections run
    postgres: PostgresServer | None = None  # set while the PostgreSQL sections run

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


@dataclass(frozen=True)
class Target:
    """Where a scenario locks: a backend kind, its lock directory, lockrun URI and lock name."""

    kind: Kind
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


def make_target(bench: Bench, kind: Kind, scenario: Path) -> Target:
    """Return a target of *kind* private to *scenario* (its own directory, prefix or name)."""
    directory = scenario / "locks"
    directory.mkdir(exist_ok=True)
    if kind == "redis":
        return Target(kind, directory, redis_server(bench).uri, f"{NAME}-{scenario.name}")
    if kind in MYSQL_KINDS:
        server = mysql_server(bench)
        uri = server.uri if kind == "mysql" else server.socket_uri
        return Target(kind, directory, uri, f"{NAME}-{scenario.name}")
    if kind in POSTGRES_KINDS:
        postgres = postgres_server(bench)
        uri = postgres.uri if kind == "postgres" else postgres.socket_uri
        return Target(kind, directory, uri, f"{NAME}-{scenario.name}")
    uri = f"abstract:bench{os.getpid()}-{scenario.name}" if kind == "abstract" else ""
    return Target(kind, directory, uri or f"file://{directory}")


class Processes:
    """The processes of one scenario; leaving the block releases, stops and reaps them all."""

    def __init__(self, directory: Path) -> None:
        """Keep stderr files and GO triggers in *directory*."""
        self.directory = directory
        self.started: list[subprocess.Popen[bytes]] = []
        self.triggers: list[Path] = []

    def __enter__(self) -> Self:
        """Start collecting processes."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop whatever is still running."""
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


def cpu_seconds(pid: int) -> float:
    """Return the user plus system CPU time *pid* has used, in seconds (clock ticks)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run_seconds(pid: int, task: int | None = None) -> float:
    """Return the time *pid*'s main thread (or *task*) spent on a CPU, to the ns (schedstat)."""
    return int((proc_dir(pid, task) / "schedstat").read_text().split()[0]) / 1e9


def context_switches(pid: int, task: int | None = None) -> int:
    """Return how often *pid* (or its thread *task*) was switched out: its wake-ups, roughly."""
    total = 0
    for line in (proc_dir(pid, task) / "status").read_text().splitlines():
        if "ctxt_switches:" in line:
            total += int(line.split()[-1])
    return total


def proc_dir(pid: int, task: int | None = None) -> Path:
    """Return /proc/PID, or /proc/PID/task/TASK for one thread of it."""
    return Path(f"/proc/{pid}") if task is None else Path(f"/proc/{pid}/task/{task}")


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


def blocked_pids(server: RedisServer, pids: set[int]) -> set[int]:
    """Return which of *pids* sleep in a blocking command (BLPOP) on *server*.

    CLIENT LIST names each blocked client's port; /proc/net/tcp turns the port into a socket
    inode, and the processes' fds say whose socket that is.
    """
    ports = set()
    for line in redis_call(server.port, "CLIENT", "LIST").splitlines():
        client = {key: value for key, _, value in (item.partition("=") for item in line.split())}
        if "b" in client.get("flags", ""):
            ports.add(int(client["addr"].rpartition(":")[2]))
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # sl local_address rem_address st ... uid timeout inode
        local, remote = (int(address.rpartition(":")[2], 16) for address in fields[1:3])
        if local in ports and remote == server.port:
            inodes.add(f"socket:[{fields[9]}]")
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            fds = Path(f"/proc/{pid}/fd")
            if any(os.readlink(fds / fd) in inodes for fd in os.listdir(fds)):
                found.add(pid)
    return found


def abstract_waiters(bench: Bench, target: Target) -> set[int]:
    """Return the pids `lockrun status --json` lists as waiting for the target's lock."""
    out = subprocess.run(
        [*bench.lockrun, "status", "--uri", target.uri, "--json", target.name],
        capture_output=True,
        check=False,
        text=True,
    )
    if out.returncode != 0:
        msg = f"exit {out.returncode} from lockrun status --uri {target.uri}: {out.stderr.strip()}"
        raise Broken(msg)
    states = json.loads(out.stdout)
    return {int(waiter["pid"]) for state in states for waiter in state["waiters"]}


def queued_pids(bench: Bench, target: Target, wanted: set[int]) -> set[int]:
    """Return which of *wanted* are queued for *target*'s lock right now."""
    if target.kind == "abstract":
        return abstract_waiters(bench, target) & wanted
    if target.kind == "redis":
        return blocked_pids(redis_server(bench), wanted)
    if target.kind in MYSQL_KINDS:
        return mysql_server(bench).waiting_pids(target.name) & wanted
    if target.kind in POSTGRES_KINDS:
        return postgres_server(bench).waiting_pids(target.name) & wanted
    return flock_pids(target.directory) & wanted


def queue_pause(kind: Kind, waiters: int) -> float:
    """Return how long to pause between two looks at the queue of *waiters* of *kind*."""
    if kind == "abstract":  # `lockrun status` costs a process start
        return 0.02 if waiters == 1 else 0.25
    if kind == "redis":
        return 0.005 if waiters == 1 else 0.1
    if kind in MYSQL_KINDS:  # one PROCESSLIST query on the bench's open session
        return 0.002 if waiters == 1 else 0.05
    if kind in POSTGRES_KINDS:  # one pg_stat_activity query on the bench's open session
        return 0.002 if waiters == 1 else 0.05
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
    pause = queue_pause(target.kind, len(wanted))

    def queued() -> set[int]:
        return queued_pids(bench, target, wanted)

    def done() -> bool:
        return any(proc.poll() is not None for proc in waiters) or len(queued()) == len(wanted)

    # Seen all at once is enough: a Redis waiter leaves BLPOP for a moment when it re-asks.
    seen = poll_until(done, timeout, pause)
    exited = [proc for proc in waiters if proc.poll() is not None]
    if exited:
        early = exited[0]
        msg = f"waiter exited {early.returncode} before it was granted: {command_line(early)}"
        raise Broken(f"{msg} ({procs.stderr_of(early)})")
    if not seen:
        msg = f"{len(queued())} of {len(wanted)} waiters queued after {timeout:.0f}s"
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


# -- building blocks -----------------------------------------------------------------------


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


def row(what: str, numbers: str, target: str = "", verdict: str = "") -> None:
    """Print one report line: what, the numbers, the target and PASS/MISS."""
    print(f"  {what:<34} {numbers:<40} {target:<10} {verdict}".rstrip())


def verdict(ok: bool) -> str:
    """Return PASS or MISS."""
    return "PASS" if ok else "MISS"


def section(title: str) -> None:
    """Print a section heading."""
    print(f"\n{title}\n{'-' * len(title)}")


def describe_ms(values: Sequence[float]) -> str:
    """Return median and max of *values* (milliseconds) as text."""
    return f"median {statistics.median(values):6.2f} ms  max {max(values):6.2f} ms  n={len(values)}"


def describe_tail(values: Sequence[float]) -> str:
    """Return median and 99th percentile of *values* (milliseconds) as text."""
    p99 = (
        statistics.quantiles(values, n=100, method="inclusive")[98]
        if len(values) > 1
        else values[0]
    )
    return f"median {statistics.median(values):6.2f} ms  p99 {p99:6.2f} ms  n={len(values)}"


# -- (a) startup ---------------------------------------------------------------------------


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


def startup_medians(
    bench: Bench, commands: dict[str, list[str]], runs: int, what: str
) -> dict[str, float] | None:
    """Time *commands* interleaved and print their medians; None (a problem) if one failed."""
    try:
        medians = {
            label: statistics.median(values)
            for label, values in time_commands(commands, runs).items()
        }
    except subprocess.CalledProcessError as err:
        bench.broke(what, Broken(f"exit {err.returncode} from {shlex.join(err.cmd)}"))
        return None
    for label, median in medians.items():
        row(label, f"{median * 1000:7.1f} ms")
    return medians


def startup_section(bench: Bench) -> None:
    """Report (a): compare `lockrun -- true` with importing click and with flock(1)."""
    runs = bench.plan.startup_runs
    section(f"(a) Startup: median wall time of {runs} runs each")
    scenario = bench.scenario_dir("startup")
    file_target = make_target(bench, "file", scenario)
    abstract_target = make_target(bench, "abstract", scenario)
    commands = {
        "lockrun --uri file:DIR -- true": file_target.argv(bench.lockrun, ["true"]),
        "lockrun --uri abstract: -- true": abstract_target.argv(bench.lockrun, ["true"]),
        "python -c 'import click'": [sys.executable, "-c", "import click"],
        "python -c pass": [sys.executable, "-c", "pass"],
        "flock DIR/x true": [FLOCK, str(scenario / "x"), "true"],
    }
    medians = startup_medians(bench, commands, runs, "startup")
    if medians is None:
        return
    click_time, flock_time = medians["python -c 'import click'"], medians["flock DIR/x true"]
    for backend in ("file", "abstract"):
        label = f"lockrun --uri {backend}:{'DIR' if backend == 'file' else ''} -- true"
        ratio = medians[label] / click_time
        target = f"<= {STARTUP_TARGET}x"
        row(f"{backend}: lockrun / import click", f"{ratio:5.2f}x", target, verdict(ratio <= 1.3))
        row(f"{backend}: lockrun / flock(1)", f"{medians[label] / flock_time:5.1f}x")


# -- (b) handoff ---------------------------------------------------------------------------


def handoff_trial(bench: Bench, kind: Kind) -> float:
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


def handoff_section(bench: Bench) -> None:
    """Report (b): handoff latency of lockrun's file and abstract backends against flock(1)."""
    trials = bench.plan.handoff_trials
    section(f"(b) Handoff: holder's command exits -> waiter's command starts, {trials} trials")
    labels: dict[Kind, str] = {
        "file": "lockrun, file backend",
        "abstract": "lockrun, abstract backend",
        "flock": "flock(1) on a file",
    }
    results, broken = handoff_trials(bench, labels, trials)
    for kind, values in results.items():
        if values and kind not in broken:
            row(labels[kind], describe_ms(values))
    handoff_verdicts(results, broken)


def handoff_trials(
    bench: Bench, labels: dict[Kind, str], trials: int
) -> tuple[dict[Kind, list[float]], set[Kind]]:
    """Run *trials* handoffs of every kind in *labels*, interleaved; return ms and the broken."""
    results: dict[Kind, list[float]] = {kind: [] for kind in labels}
    broken: set[Kind] = set()
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


def handoff_verdicts(results: dict[Kind, list[float]], broken: set[Kind]) -> None:
    """Print the handoff targets: file <= 2x flock(1), abstract <= 10 ms."""
    if broken:
        return
    flock_median = statistics.median(results["flock"])
    file_ratio = statistics.median(results["file"]) / flock_median
    ok = file_ratio <= FILE_HANDOFF_RATIO
    row(
        "file: lockrun / flock(1), median",
        f"{file_ratio:5.2f}x",
        f"<= {FILE_HANDOFF_RATIO}x",
        verdict(ok),
    )
    server_verdict("abstract", results["abstract"], flock_median)


def server_verdict(kind: Kind, values: Sequence[float], flock_median: float) -> None:
    """Print a non-file backend's handoff against flock(1) and its target, median <= 10 ms."""
    median = statistics.median(values)
    row(f"{kind}: lockrun / flock(1)", f"{median / flock_median:5.2f}x")
    ok = median <= OTHER_HANDOFF_MS
    row(f"{kind}: median", f"{median:6.2f} ms", f"<= {OTHER_HANDOFF_MS:.0f} ms", verdict(ok))


# -- (c) idle waiters ----------------------------------------------------------------------


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
        """Return the sum of both."""
        return Usage(self.cpu + other.cpu, self.run + other.run, self.switches + other.switches)

    def __sub__(self, other: Usage) -> Usage:
        """Return what was spent from *other* to this sample."""
        return Usage(self.cpu - other.cpu, self.run - other.run, self.switches - other.switches)


NOTHING: Final = Usage(0.0, 0.0, 0)


def threads_usage(pid: int) -> Usage:
    """Sample a multi-threaded *pid*: its CPU, and its live threads' run time and switches.

    mariadbd runs a thread per connection plus InnoDB's own; the main thread alone says
    nothing. A thread that ends between two samples takes its share of the exact numbers
    with it (the CPU column, the process's own, keeps it).
    """
    total = Usage(cpu_seconds(pid), 0.0, 0)
    for entry in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            task = int(entry)
            total += Usage(0.0, run_seconds(pid, task), context_switches(pid, task))
    return total


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


class LockServer(Protocol):
    """A lock server of the bench's own, as the idle scenarios measure it."""

    def usage(self) -> Usage:
        """Sample the server's process now."""
        ...

    def clients(self) -> tuple[int, int]:
        """Return how many clients are connected, not counting the probe, and how many wait."""
        ...


@dataclass(frozen=True)
class ServerLoad:
    """What the lock server spent over the idle window, and the connections it counted."""

    usage: Usage
    connected: int  # its clients at the window's end, without our probe
    blocked: int  # of which blocked (in BLPOP, inside GET_LOCK or pg_advisory_lock)

    @classmethod
    def since(cls, server: LockServer, start: Usage) -> ServerLoad:
        """Measure *server* now: its CPU since *start* and its clients."""
        usage = server.usage() - start
        return cls(usage, *server.clients())


@dataclass(frozen=True)
class IdleResult:
    """What the idle waiters cost during the window, and how long they took to drain."""

    usage: Usage
    processes: int  # the waiters and their children
    drain: float
    server: ServerLoad | None = None
    left: int = 0  # the server's connections once every waiter had run and exited


def idle_scenario(bench: Bench, kind: Kind, slots: int, waiters: int, window: float) -> IdleResult:
    """Hold *slots* slots, queue the waiters, measure their CPU over the window, drain.

    With a server's target (redis, mysql, postgres), the server's CPU over the same window and its
    clients are measured too.
    """
    scenario = bench.scenario_dir(f"idle-{kind}-{slots}")
    target = make_target(bench, kind, scenario)
    server = lock_server(bench, kind)
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
        server_start = None if server is None else server.usage()
        time.sleep(window)
        after = family_usage(pids)
        load = None
        if server is not None and server_start is not None:
            load = ServerLoad.since(server, server_start)
        go.touch()
        began = time.monotonic()
        procs.finish(60.0)
        drain = time.monotonic() - began
    result = IdleResult(spent(before, after), len(after), drain, load)
    if server is None:
        return result
    poll_until(lambda: server.clients()[0] == 0, 2.0, 0.01)  # a close reaches it a bit later
    return replace(result, left=server.clients()[0])


def lock_server(bench: Bench, kind: Kind) -> LockServer | None:
    """Return the server a target of *kind* locks on, None for the local backends."""
    if kind == "redis":
        return redis_server(bench)
    if kind in MYSQL_KINDS:
        return mysql_server(bench)
    if kind in POSTGRES_KINDS:
        return postgres_server(bench)
    return None


def idle_row(what: str, usage: Usage, window: float) -> None:
    """Print CPU used over the idle window against the target (1 % of one CPU).

    The verdict takes the larger of the two figures: ticks miss what many short-lived
    processes used below a tick each, the exact run time misses processes that ended.
    """
    numbers = f"{usage.cpu:5.3f} s CPU ({usage.run * 1000:.1f} ms exact), {usage.switches} wakeups"
    target = window * IDLE_CPU_SHARE
    row(what, numbers, f"<= {target:.2g} s", verdict(max(usage.cpu, usage.run) <= target))


def idle_case(
    bench: Bench, kind: Kind, slots: int, waiters: int, window: float
) -> IdleResult | None:
    """Run one idle scenario; on trouble record the problem and return None."""
    try:
        return idle_scenario(bench, kind, slots, waiters, window)
    except (Broken, FileNotFoundError, ProcessLookupError) as err:
        problem = err if isinstance(err, Broken) else Broken(f"waiter vanished: {err}")
        bench.broke(f"{kind}: --slots {slots}", problem)
        return None


def idle_section(bench: Bench) -> None:
    """Report (c): CPU used by idle waiters over a window, per backend and slot count."""
    window = bench.plan.idle_window
    waiters = bench.plan.idle_waiters
    section(f"(c) Idle waiters: CPU of {waiters} blocked waiters over {window:.0f} s")
    for kind, slots in SCENARIOS:
        result = idle_case(bench, kind, slots, waiters, window)
        if result is not None:
            idle_row(f"{kind}: --slots {slots}", result.usage, window)
            row(f"{kind}: --slots {slots}, drain", f"all {waiters} ran in {result.drain:.2f} s")


# -- (d) FIFO ------------------------------------------------------------------------------


def fifo_scenario(bench: Bench, kind: Kind, slots: int, hold: float) -> tuple[list[int], list[int]]:
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


def fifo_section(bench: Bench) -> None:
    """Report (d): do waiters get the lock in the order they queued."""
    section(f"(d) FIFO: {fifo_setup(bench)}")
    fifo_cases(bench, SCENARIOS)


def fifo_setup(bench: Bench) -> str:
    """Describe how the FIFO scenarios queue their waiters."""
    waiters = bench.plan.fifo_waiters
    return f"{waiters} waiters queued {FIFO_SPACING * 1000:.0f} ms apart, then release"


def fifo_cases(bench: Bench, scenarios: Iterable[tuple[Kind, int]]) -> None:
    """Run and report the FIFO *scenarios*, released at once and, unless quick, after a wait."""
    holds = [0.0, LONG_HOLD] if bench.plan.long_fifo else [0.0]
    for hold in holds:
        if hold:
            print(f"  -- released {hold:.0f} s after the first waiter queued (long waits):")
        for kind, slots in scenarios:
            fifo_case(bench, kind, slots, hold)
    if not bench.plan.long_fifo:
        row(f"release after {LONG_HOLD:.0f} s", "skipped with --quick")


def fifo_case(bench: Bench, kind: Kind, slots: int, hold: float) -> None:
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
    if granted != arrival:  # algorithms.md test 19 lets N slots be overtaken N-1 times
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


# -- (e) to (h) Redis ----------------------------------------------------------------------


class Unavailable(Exception):
    """The Redis, MySQL or PostgreSQL sections cannot run here; the message says why."""


def free_port() -> int:
    """Return a loopback TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def redis_call(port: int, *args: str, timeout: float = 5.0) -> str:
    """Send one command to the Redis server on loopback *port*; return its reply as text."""
    request = b"*%d\r\n" % len(args)
    for arg in args:
        data = arg.encode()
        request += b"$%d\r\n%s\r\n" % (len(data), data)
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection,
            connection.makefile("rb") as reply,
        ):
            connection.sendall(request)
            return read_reply(reply)
    except OSError as err:
        msg = f"redis-server on 127.0.0.1:{port}: {err}"
        raise Broken(msg) from err


def read_reply(reply: BinaryIO) -> str:
    """Read one RESP reply other than an array: +simple, :integer, $bulk (or -error)."""
    line = reply.readline()
    kind, text = line[:1], line[1:].rstrip(b"\r\n").decode(errors="replace")
    if kind in {b"+", b":"}:
        return text
    if kind == b"$":
        size = int(text)
        return "" if size < 0 else reply.read(size + 2)[:size].decode(errors="replace")
    msg = f"redis-server replied {text}" if kind == b"-" else f"bad reply {line[:80]!r}"
    raise Broken(msg)


@dataclass(frozen=True)
class RedisServer:
    """A throwaway redis-server of the bench's own on a loopback TCP port: nothing saved."""

    process: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.process.pid

    @property
    def uri(self) -> str:
        """The lock URI that reaches the server over TCP, like a real deployment."""
        return f"redis://127.0.0.1:{self.port}/0"

    def usage(self) -> Usage:
        """Sample the server now (its main thread does the work)."""
        return Usage.of(self.pid)

    def ping(self) -> bool:
        """Tell whether the server answers PING."""
        with contextlib.suppress(Broken):
            return redis_call(self.port, "PING", timeout=1.0) == "PONG"
        return False

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server answers PING (True), or exits or *timeout* passes (False)."""
        poll_until(lambda: self.process.poll() is not None or self.ping(), timeout, 0.005)
        return self.process.poll() is None and self.ping()

    def info(self, part: str) -> dict[str, str]:
        """Return one section of INFO as a dict."""
        lines = redis_call(self.port, "INFO", part).splitlines()
        return {key: value for key, _, value in (line.partition(":") for line in lines) if value}

    def clients(self) -> tuple[int, int]:
        """Return how many clients are connected, not counting this probe, and how many block."""
        info = self.info("clients")
        return int(info["connected_clients"]) - REDIS_PROBE, int(info["blocked_clients"])

    def log(self) -> str:
        """Return the last lines the server wrote to its log or its stderr."""
        text = ""
        for name in ("stderr", "redis.log"):
            with contextlib.suppress(OSError):
                text += (self.directory / name).read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-3:])

    def stop(self) -> None:
        """Stop the server: TERM, then KILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_redis(directory: Path) -> RedisServer:
    """Start a redis-server in *directory* on a free loopback port; `Unavailable` if it can't."""
    binary = shutil.which(REDIS_SERVER)
    if binary is None:
        msg = f"{REDIS_SERVER} is not installed (not found on PATH)"
        raise Unavailable(msg)
    directory.mkdir()
    for _ in range(3):  # someone else may bind the free port before the server does
        server = launch_redis(binary, directory, free_port())
        if server.wait_ready(REDIS_START):
            return server
        server.stop()
        if "Address already in use" not in server.log():
            break
    msg = f"{REDIS_SERVER} did not answer PING on 127.0.0.1:{server.port}: {server.log()}"
    raise Unavailable(msg)


def launch_redis(binary: str, directory: Path, port: int) -> RedisServer:
    """Start redis-server on *port* without waiting for it; it saves nothing anywhere."""
    # A server of our own, in its own session: it must not save a dump.rdb into the cwd.
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no", "--dir", str(directory)]
    command += ["--logfile", str(directory / "redis.log")]
    with (directory / "stderr").open("ab") as errors:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,
        )
    return RedisServer(process, port, directory)


def redis_sections(bench: Bench) -> None:
    """Report (e) to (h) for the redis backend, measured against a redis-server of our own."""
    try:
        server = start_redis(bench.root / "redis")
    except (Unavailable, OSError) as err:
        section("(e) to (h) Redis: skipped")
        row("redis backend", f"skipped: {err}")
        return
    bench.redis = server
    try:
        sections = (
            redis_startup_section,
            redis_handoff_section,
            redis_idle_section,
            redis_fifo_section,
        )
        for run in sections:
            timed(bench, run)
    finally:
        bench.redis = None
        server.stop()


def redis_server(bench: Bench) -> RedisServer:
    """Return the running server of the Redis sections."""
    if bench.redis is None:
        msg = "no redis-server is running"
        raise Broken(msg)
    return bench.redis


def redis_startup_section(bench: Bench) -> None:
    """Report (e): `lockrun --uri redis://… -- true` against importing click and redis."""
    runs = bench.plan.redis_startup_runs
    server = redis_server(bench)
    section(f"(e) Redis startup: median wall time of {runs} runs each")
    version = server.info("server").get("redis_version", "?")
    row("server", f"redis-server {version}, {server.uri}")
    target = make_target(bench, "redis", bench.scenario_dir("startup-redis"))
    lockrun, drivers, click = (
        "lockrun --uri redis://… -- true",
        "python -c 'import click, redis'",
        "python -c 'import click'",
    )
    commands = {
        lockrun: target.argv(bench.lockrun, ["true"]),
        drivers: [sys.executable, "-c", "import click, redis"],
        click: [sys.executable, "-c", "import click"],
    }
    medians = startup_medians(bench, commands, runs, "redis startup")
    if medians is None:
        return
    ratio = medians[lockrun] / medians[drivers]
    target_text = f"<= {STARTUP_TARGET}x"
    row(
        "lockrun / import click, redis",
        f"{ratio:5.2f}x",
        target_text,
        verdict(ratio <= STARTUP_TARGET),
    )
    row("lockrun / import click", f"{medians[lockrun] / medians[click]:5.2f}x")


def redis_handoff_section(bench: Bench) -> None:
    """Report (f): handoff latency through Redis over TCP, median and p99, against flock(1)."""
    trials = bench.plan.redis_handoff_trials
    section(f"(f) Redis handoff: holder's command exits -> waiter's starts, {trials} trials")
    labels: dict[Kind, str] = {
        "redis": "lockrun, redis backend (TCP)",
        "flock": "flock(1) on a file",
    }
    results, broken = handoff_trials(bench, labels, trials)
    redis_ms, flock_ms = results["redis"], results["flock"]
    if "redis" not in broken:
        row(labels["redis"], describe_tail(redis_ms))
        slowest = "  ".join(f"{value:.2f}" for value in sorted(redis_ms, reverse=True)[:3])
        row("redis: slowest three", f"{slowest} ms")
    if "flock" not in broken:
        row(labels["flock"], describe_ms(flock_ms))
    if not broken:
        server_verdict("redis", redis_ms, statistics.median(flock_ms))


def redis_idle_section(bench: Bench) -> None:
    """Report (g): waiters' and server's CPU over an idle window, connections, drain time."""
    waiters, window = bench.plan.redis_idle_waiters, bench.plan.redis_idle_window
    slots = 1
    section(
        f"(g) Redis idle waiters: {waiters} waiters (-w forever) on a held name, {window:.0f} s"
    )
    result = idle_case(bench, "redis", slots, waiters, window)
    if result is None or result.server is None:
        return
    children = result.processes - waiters
    idle_row(f"{waiters} waiters + {children} children", result.usage, window)
    per_waiter = f"{result.usage.run * 1000 / waiters:.3f} ms CPU (exact), "
    per_waiter += f"{result.usage.switches / waiters:.1f} wakeups"
    row("per waiter, over the window", per_waiter)
    server = result.server
    idle_row("redis-server, same window", server.usage, window)
    theirs = server.connected - slots
    share = theirs / waiters
    numbers = (
        f"{share:4.2f}: {server.connected} = {theirs} + {slots} holder; {server.blocked} blocked"
    )
    row("connections per waiter", numbers, "<= 1.00", verdict(share <= 1.0))
    drained = f"all {waiters} ran in {result.drain:.2f} s; {result.left} connections left"
    row("after release, drain", drained)


def redis_fifo_section(bench: Bench) -> None:
    """Report (h): FIFO order through Redis, with one slot and with three."""
    section(f"(h) Redis FIFO: {fifo_setup(bench)}")
    fifo_cases(bench, REDIS_SCENARIOS)


# -- (i) to (l) MySQL ----------------------------------------------------------------------


@dataclass
class MariaServer:
    """A throwaway mariadbd of the bench's own: a fresh data directory, TCP and a socket."""

    process: subprocess.Popen[bytes]
    port: int
    directory: Path
    probe: pymysql.Connection[Any] | None = None  # the bench's session, on the unix socket
    ready_in: float = 0.0  # seconds from mariadb-install-db to the first session

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.process.pid

    @property
    def socket(self) -> Path:
        """The server's unix socket."""
        return self.directory / "mysqld.sock"

    @property
    def uri(self) -> str:
        """The lock URI that reaches the server over TCP, like a real deployment."""
        return f"mysql://root@127.0.0.1:{self.port}/{MYSQL_DATABASE}"

    @property
    def socket_uri(self) -> str:
        """The lock URI that reaches the server over its unix socket."""
        return f"mysql://root@localhost/{MYSQL_DATABASE}?unix_socket={self.socket}"

    def query(self, sql: str, args: object = None) -> tuple[tuple[Any, ...], ...]:
        """Run *sql* on the bench's own session (opened on first use); return every row."""
        try:
            if self.probe is None:
                self.probe = pymysql.connect(
                    unix_socket=str(self.socket),
                    user="root",
                    password="",
                    autocommit=True,
                    connect_timeout=5,
                    read_timeout=10,
                    write_timeout=10,
                )
            with self.probe.cursor() as cursor:
                cursor.execute(sql, args)
                return tuple(cursor.fetchall())
        except pymysql.err.Error as err:
            self.close_probe()
            msg = f"mariadbd on {self.socket}: {err}"
            raise Broken(msg) from err

    def close_probe(self) -> None:
        """Close the bench's session, if open; never raises."""
        probe, self.probe = self.probe, None
        if probe is not None:
            with contextlib.suppress(pymysql.err.Error, OSError):
                probe.close()

    def ready(self) -> bool:
        """Tell whether the server accepts a session on its socket."""
        with contextlib.suppress(Broken):
            return self.query("SELECT 1") == ((1,),)
        return False

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server answers (True), or exits or *timeout* passes (False)."""
        poll_until(lambda: self.process.poll() is not None or self.ready(), timeout, 0.01)
        return self.process.poll() is None and self.ready()

    def version(self) -> str:
        """Return the server's version string."""
        return str(self.query("SELECT VERSION()")[0][0])

    def usage(self) -> Usage:
        """Sample the server now: all its threads (one per connection, InnoDB's own)."""
        return threads_usage(self.pid)

    def clients(self) -> tuple[int, int]:
        """Return how many sessions are connected, not counting the probe, and how many wait."""
        connected = self.query("SHOW GLOBAL STATUS LIKE 'Threads\\_connected'")[0][1]
        waiting = self.query(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = %s", (USER_LOCK,)
        )[0][0]
        return int(connected) - MYSQL_PROBE, int(waiting)

    def waiting_pids(self, name: str) -> set[int]:
        """Return the pids of the lockrun processes with a session blocked in GET_LOCK on *name*.

        Such a session's STATE is 'User lock', and its statement carries the waiter's
        `/* lockrun {json} */` tag: lock name and holder pid. The head of a semaphore's
        queue waits on the slots, the others on the gate: all are queued.
        """
        rows = self.query(
            "SELECT INFO FROM information_schema.PROCESSLIST WHERE STATE = %s AND INFO LIKE %s",
            (USER_LOCK, "%/* lockrun %"),
        )
        pids = set()
        for (info,) in rows:
            match = WAITER_TAG.search(str(info))
            if match is None:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                who = json.loads(match[1])
                if who["name"] == name:
                    pids.add(int(who["holder"]["pid"]))
        return pids

    def log(self) -> str:
        """Return the last lines the server (or mariadb-install-db) wrote."""
        text = ""
        for name in ("install.log", "stderr", "err.log"):
            with contextlib.suppress(OSError):
                text += (self.directory / name).read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-3:])

    def kill(self) -> None:
        """Kill the server: it is thrown away, nothing to flush."""
        self.close_probe()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_mysql(directory: Path) -> MariaServer:
    """Make a data directory and start mariadbd on it; `Unavailable` if it can't."""
    began = time.monotonic()
    server_binary, install_binary = shutil.which(MARIADBD), shutil.which(MARIADB_INSTALL)
    if server_binary is None or install_binary is None:
        missing = MARIADBD if server_binary is None else MARIADB_INSTALL
        msg = f"{missing} is not installed (not found on PATH)"
        raise Unavailable(msg)
    directory.mkdir()
    user = pwd.getpwuid(os.geteuid()).pw_name  # root, as a rule; the server runs as us
    install = [install_binary, "--no-defaults", f"--datadir={directory / 'data'}"]
    install += ["--auth-root-authentication-method=normal", "--skip-test-db", f"--user={user}"]
    install += [f"--tmpdir={directory}"]  # two bootstraps at once in /tmp collide
    with (directory / "install.log").open("wb") as log:
        try:
            status = subprocess.run(
                install,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=MYSQL_INSTALL,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            status = -1
    if status != 0:
        text = (directory / "install.log").read_text(errors="replace").strip().splitlines()
        msg = f"{MARIADB_INSTALL} failed (status {status}): {' | '.join(text[-3:])}"
        raise Unavailable(msg)
    for _ in range(3):  # someone else may bind the free port before the server does
        server = launch_mysql(server_binary, directory, free_port(), user)
        try:
            if server.wait_ready(MYSQL_START):
                server.query(f"CREATE DATABASE {MYSQL_DATABASE}")
                server.ready_in = time.monotonic() - began
                return server
        except Broken as err:
            server.stop()
            raise Unavailable(str(err)) from err
        except BaseException:  # Ctrl-C, TERM: no server of ours outlives the bench
            server.stop()
            raise
        server.kill()
        if "already in use" not in server.log():
            break
    msg = f"{MARIADBD} did not accept a session on {server.socket}: {server.log()}"
    raise Unavailable(msg)


def launch_mysql(binary: str, directory: Path, port: int, user: str) -> MariaServer:
    """Start mariadbd on *port* and a socket in *directory*, without waiting for it."""
    (directory / "tmp").mkdir(exist_ok=True)
    command = [binary, "--no-defaults", f"--datadir={directory / 'data'}"]
    command += [f"--socket={directory / 'mysqld.sock'}", "--bind-address=127.0.0.1"]
    command += [f"--port={port}", f"--user={user}", "--innodb-buffer-pool-size=16M"]
    command += ["--max-connections=400", f"--log-error={directory / 'err.log'}"]
    # Its temporary tables (a PROCESSLIST query makes one) stay inside its directory too.
    command += [f"--tmpdir={directory / 'tmp'}"]
    with (directory / "stderr").open("ab") as errors:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,
        )
    return MariaServer(process, port, directory)


def mysql_sections(bench: Bench) -> None:
    """Report (i) to (l) for the mysql backend, measured against a mariadbd of our own."""
    try:
        server = start_mysql(bench.root / "mysql")
    except (Unavailable, OSError) as err:
        section("(i) to (l) MySQL: skipped")
        row("mysql backend", f"skipped: {err}")
        return
    bench.mysql = server
    try:
        sections = (
            mysql_startup_section,
            mysql_handoff_section,
            mysql_idle_section,
            mysql_fifo_section,
        )
        for run in sections:
            timed(bench, run)
    finally:
        bench.mysql = None
        server.stop()


def mysql_server(bench: Bench) -> MariaServer:
    """Return the running server of the MySQL sections."""
    if bench.mysql is None:
        msg = "no mariadbd is running"
        raise Broken(msg)
    return bench.mysql


def mysql_startup_section(bench: Bench) -> None:
    """Report (i): `lockrun --uri mysql://… -- true` against importing click and pymysql."""
    runs = bench.plan.mysql_startup_runs
    server = mysql_server(bench)
    section(f"(i) MySQL startup: median wall time of {runs} runs each")
    try:
        row("server", f"mariadbd {server.version()}, {server.uri}")
    except Broken as err:
        bench.broke("mysql startup", err)
        return
    row("server start", f"{server.ready_in:.1f} s: a fresh data directory, then a session")
    target = make_target(bench, "mysql", bench.scenario_dir("startup-mysql"))
    lockrun, drivers, click = (
        "lockrun --uri mysql://… -- true",
        "python -c 'import click, pymysql'",
        "python -c 'import click'",
    )
    commands = {
        lockrun: target.argv(bench.lockrun, ["true"]),
        drivers: [sys.executable, "-c", "import click, pymysql"],
        click: [sys.executable, "-c", "import click"],
    }
    medians = startup_medians(bench, commands, runs, "mysql startup")
    if medians is None:
        return
    ratio = medians[lockrun] / medians[drivers]
    row(
        "lockrun / import click, pymysql",
        f"{ratio:5.2f}x",
        f"<= {STARTUP_TARGET}x",
        verdict(ratio <= STARTUP_TARGET),
    )
    row("lockrun / import click", f"{medians[lockrun] / medians[click]:5.2f}x")


def mysql_handoff_section(bench: Bench) -> None:
    """Report (j): handoff latency through MySQL over TCP (and a socket), against flock(1)."""
    trials = bench.plan.mysql_handoff_trials
    section(f"(j) MySQL handoff: holder's command exits -> waiter's starts, {trials} trials")
    labels: dict[Kind, str] = {
        "mysql": "lockrun, mysql backend (TCP)",
        "mysql-socket": "lockrun, mysql backend (socket)",
        "flock": "flock(1) on a file",
    }
    if not bench.plan.mysql_socket:
        del labels["mysql-socket"]
    results, broken = handoff_trials(bench, labels, trials)
    mysql_ms, flock_ms = results["mysql"], results["flock"]
    if "mysql" not in broken:
        row(labels["mysql"], describe_tail(mysql_ms))
        slowest = "  ".join(f"{value:.2f}" for value in sorted(mysql_ms, reverse=True)[:3])
        row("mysql: slowest three", f"{slowest} ms")
    if "mysql-socket" not in labels:
        row("mysql backend (socket)", "skipped with --quick")
    elif "mysql-socket" not in broken:
        row(labels["mysql-socket"], describe_tail(results["mysql-socket"]))
    if "flock" not in broken:
        row(labels["flock"], describe_ms(flock_ms))
    if not {"mysql", "flock"} & broken:
        server_verdict("mysql", mysql_ms, statistics.median(flock_ms))


def mysql_idle_section(bench: Bench) -> None:
    """Report (k): idle waiters' and server's CPU, connections and drain, N = 1 and 3."""
    waiters, window = bench.plan.mysql_idle_waiters, bench.plan.mysql_idle_window
    section(
        f"(k) MySQL idle waiters: {waiters} waiters (-w forever) on a held name, {window:.0f} s"
    )
    for slots in (1, 3):
        result = idle_case(bench, "mysql", slots, waiters, window)
        if result is None or result.server is None:
            continue
        what = f"--slots {slots}"
        children = result.processes - waiters
        idle_row(f"{what}: {waiters} waiters + children", result.usage, window)
        per_waiter = f"{result.usage.run * 1000 / waiters:.3f} ms CPU (exact), "
        per_waiter += f"{result.usage.switches / waiters:.1f} wakeups; {children} children"
        row(f"{what}: per waiter", per_waiter)
        server = result.server
        idle_row(f"{what}: mariadbd, same window", server.usage, window)
        # MariaDB and MySQL wake each session waiting in GET_LOCK once a second to see if
        # its client is still connected: the server's cost grows with the queue.
        each = f"{server.usage.run * 1000 / waiters / window:.3f} ms CPU/s, "
        each += f"{server.usage.switches / waiters / window:.2f} wakeups/s"
        row(f"{what}: mariadbd per waiter", each)
        # One session per waiter, and N - 1 more for the head, which waits on every slot.
        theirs, expected = server.connected - slots, waiters + slots - 1
        holders = "1 holder" if slots == 1 else f"{slots} holders"
        numbers = f"{server.connected} = {theirs} + {holders}; {server.blocked} in GET_LOCK"
        row(f"{what}: sessions", numbers, f"<= {expected}", verdict(theirs <= expected))
        drained = f"all {waiters} ran in {result.drain:.2f} s; {result.left} sessions left"
        row(f"{what}: after release, drain", drained)


def mysql_fifo_section(bench: Bench) -> None:
    """Report (l): FIFO order through MySQL, with one slot and with three."""
    section(f"(l) MySQL FIFO: {fifo_setup(bench)}")
    fifo_cases(bench, MYSQL_SCENARIOS)


# -- (m) to (p) PostgreSQL -----------------------------------------------------------------


@dataclass
class PostgresServer:
    """A throwaway postgres of the bench's own: a fresh cluster, TCP and a unix socket."""

    process: subprocess.Popen[bytes]  # the postmaster; every backend is a child of it
    port: int
    directory: Path  # data/, the socket, the logs; owned by the postgres account under root
    binaries: Path  # where initdb, postgres, pg_isready and psql are
    probe: psycopg.Connection[tuple[Any, ...]] | None = None  # the bench's session, on the socket
    ready_in: float = 0.0  # seconds from initdb to the first session

    @property
    def pid(self) -> int:
        """The postmaster's process id."""
        return self.process.pid

    @property
    def socket(self) -> Path:
        """The server's unix socket."""
        return self.directory / f".s.PGSQL.{self.port}"

    @property
    def uri(self) -> str:
        """The lock URI that reaches the server over TCP, like a real deployment."""
        return f"postgresql://{POSTGRES_USER}@127.0.0.1:{self.port}/{POSTGRES_DATABASE}"

    @property
    def socket_uri(self) -> str:
        """The lock URI that reaches the server over its unix socket."""
        where = f"host={self.directory}&port={self.port}"
        return f"postgresql://{POSTGRES_USER}@/{POSTGRES_DATABASE}?{where}"

    def query(self, sql: str, args: Sequence[object] = ()) -> tuple[tuple[Any, ...], ...]:
        """Run *sql* on the bench's own session (opened on first use); return every row."""
        import psycopg  # noqa: PLC0415 - the postgres extra is optional; start_postgres checked

        try:
            if self.probe is None:
                self.probe = psycopg.connect(
                    host=str(self.directory),
                    port=self.port,
                    user=POSTGRES_USER,
                    dbname=POSTGRES_DATABASE,
                    autocommit=True,
                    connect_timeout=5,
                    options="-c statement_timeout=10s",
                )
            with self.probe.cursor() as cursor:
                cursor.execute(sql, args)
                return tuple(cursor.fetchall())
        except psycopg.Error as err:
            self.close_probe()
            msg = f"postgres on {self.socket}: {' '.join(str(err).split())}"
            raise Broken(msg) from err

    def close_probe(self) -> None:
        """Close the bench's session, if open; never raises."""
        probe, self.probe = self.probe, None
        if probe is not None:
            with contextlib.suppress(Exception):
                probe.close()

    def ready(self) -> bool:
        """Tell whether the server accepts connections on its socket (pg_isready)."""
        command = [str(self.binaries / "pg_isready"), "-q", "-h", str(self.directory)]
        command += ["-p", str(self.port)]
        try:
            status = subprocess.run(command, stdin=subprocess.DEVNULL, timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return False
        return status.returncode == 0

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server answers (True), or exits or *timeout* passes (False)."""
        poll_until(lambda: self.process.poll() is not None or self.ready(), timeout, 0.02)
        return self.process.poll() is None and self.ready()

    def create_database(self) -> None:
        """Create lockrun's database with psql, from the maintenance database."""
        command = [str(self.binaries / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1"]
        command += ["-h", str(self.directory), "-p", str(self.port), "-U", POSTGRES_USER]
        command += ["-d", "postgres", "-c", f"CREATE DATABASE {POSTGRES_DATABASE}"]
        try:
            out = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            msg = f"psql did not create database {POSTGRES_DATABASE} within 30s"
            raise Broken(msg) from err
        if out.returncode != 0:
            msg = f"exit {out.returncode} from {shlex.join(command)}: {out.stderr.strip()}"
            raise Broken(msg)

    def version(self) -> str:
        """Return the server's version string."""
        return str(self.query("SHOW server_version")[0][0])

    def usage(self) -> Usage:
        """Sample the server now: the postmaster and its children (a process per backend).

        The postmaster's cutime and cstime keep what the backends it reaped used, so a
        backend that ends between two samples still counts in the CPU column; its run time
        and switches (the exact numbers) leave with it. Each process's utime + stime is its
        run time cut to whole clock ticks: a young backend that used less than a tick in all
        shows none, so with many of them the CPU column reads low and the exact one is right.
        """
        fields = stat_fields(self.pid)
        reaped = (int(fields[13]) + int(fields[14])) / CLOCK_TICKS
        total = Usage.of(self.pid) + Usage(reaped, 0.0, 0)
        for child in descendants({self.pid}):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += Usage.of(child)
        return total

    def clients(self) -> tuple[int, int]:
        """Return how many sessions use lockrun's database (not the probe), and how many wait."""
        connected, waiting = self.query(
            "SELECT count(*), count(*) FILTER (WHERE pid IN (SELECT pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND NOT granted)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (POSTGRES_DATABASE,),
        )[0]
        return int(connected), int(waiting)

    def waiting_pids(self, name: str) -> set[int]:
        """Return the pids of the lockrun processes with a session waiting on *name*.

        Such a session waits for an advisory lock (the name's only slot, its gate, or for the
        head of a semaphore's queue every slot), and its statement carries the waiter's
        `/* lockrun {json} */` tag: lock name and holder pid. All are queued.

        pg_locks says who waits, not pg_stat_activity's wait_event: a waiting backend wakes
        every second (lockrun's client_connection_check_interval) and shows no wait event
        until it sleeps again, which on a busy machine a look at 100 waiters often catches.
        """
        rows = self.query(
            "SELECT query FROM pg_stat_activity WHERE pid IN (SELECT pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND NOT granted) AND query LIKE %s",
            ("%/* lockrun %",),
        )
        pids = set()
        for (info,) in rows:
            match = POSTGRES_TAG.search(str(info))
            if match is None:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                who = json.loads(match[1])
                if who["name"] == name:
                    pids.add(int(who["holder"]["pid"]))
        return pids

    def log(self) -> str:
        """Return the last lines the server (or initdb) wrote."""
        text = ""
        for name in ("initdb.log", "postgres.log"):
            with contextlib.suppress(OSError):
                text += (self.directory / name).read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-3:])

    def kill(self) -> None:
        """Stop the server at once (SIGQUIT: every backend ends, nothing is saved)."""
        self.close_probe()
        if self.process.poll() is not None:
            return
        family = descendants({self.pid})
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGQUIT)
        try:
            self.process.wait(POSTGRES_STOP)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for pid in family:  # a backend the postmaster could not take down with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


def postgres_binaries() -> Path:
    """Return the directory of the newest installed PostgreSQL's programs, else PATH's."""

    def version(path: str) -> tuple[int, ...]:
        number = Path(path).parent.name
        return tuple(int(part) for part in number.split(".") if part.isdigit())

    found = sorted(glob.glob(f"{POSTGRES_BINARIES}/postgres"), key=version)
    if found:
        return Path(found[-1]).parent
    binary = shutil.which(POSTGRES)
    if binary is None:
        msg = f"{POSTGRES} is not installed (not in {POSTGRES_BINARIES} nor on PATH)"
        raise Unavailable(msg)
    return Path(binary).parent


def postgres_account() -> str | None:
    """Return the account to run initdb and postgres as: the postgres user under root.

    Popen(user=) makes the child itself the server, so our signals reach the postmaster.
    """
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(POSTGRES_ACCOUNT)
    except KeyError:
        msg = f"initdb and postgres refuse to run as root, and there is no {POSTGRES_ACCOUNT} user"
        raise Unavailable(msg) from None
    return POSTGRES_ACCOUNT


def start_postgres() -> PostgresServer:
    """Make a cluster in a temporary directory and start postgres on it; `Unavailable` if not.

    The directory is not under the bench's own: the postgres account could not reach it.
    """
    began = time.monotonic()
    if importlib.util.find_spec("psycopg") is None:
        msg = "psycopg is not installed (pip install -e '.[postgres]')"
        raise Unavailable(msg)
    binaries, account = postgres_binaries(), postgres_account()
    directory = Path(tempfile.mkdtemp(prefix="lockrun-bench-pg-"))
    try:
        if account is not None:
            shutil.chown(directory, account, account)
        init_cluster(binaries, directory, account)
        server = serve_cluster(binaries, directory, account)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    server.ready_in = time.monotonic() - began
    return server


def init_cluster(binaries: Path, directory: Path, account: str | None) -> None:
    """Run initdb: a cluster in *directory*/data whose superuser lockrun logs in on trust."""
    command = [str(binaries / "initdb"), "-D", str(directory / "data"), "-A", "trust"]
    command += ["-U", POSTGRES_USER, "--no-sync"]  # thrown away: nothing to make durable
    with (directory / "initdb.log").open("wb") as log:
        try:
            status = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=directory,
                timeout=POSTGRES_INSTALL,
                check=False,
                user=account,
                group=account,
                extra_groups=None if account is None else [],
            ).returncode
        except subprocess.TimeoutExpired:
            status = -1
    if status != 0:
        text = (directory / "initdb.log").read_text(errors="replace").strip().splitlines()
        msg = f"initdb failed (status {status}): {' | '.join(text[-3:])}"
        raise Unavailable(msg)


def serve_cluster(binaries: Path, directory: Path, account: str | None) -> PostgresServer:
    """Start postgres on the cluster and create lockrun's database; `Unavailable` if not."""
    for _ in range(3):  # someone else may bind the free port before the server does
        server = launch_postgres(binaries, directory, free_port(), account)
        try:
            if server.wait_ready(POSTGRES_START):
                server.create_database()
                return server
        except Broken as err:
            server.kill()
            raise Unavailable(str(err)) from err
        except BaseException:  # Ctrl-C, TERM: no server of ours outlives the bench
            server.kill()
            raise
        server.kill()
        if "already in use" not in server.log():
            break
    msg = f"{POSTGRES} did not accept a connection on {server.socket}: {server.log()}"
    raise Unavailable(msg)


def launch_postgres(
    binaries: Path, directory: Path, port: int, account: str | None
) -> PostgresServer:
    """Start postgres on *port* and a socket in *directory*, without waiting for it."""
    command = [str(binaries / POSTGRES), "-D", str(directory / "data"), "-k", str(directory)]
    command += ["-p", str(port), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
    command += ["-c", "max_connections=400", "-c", "logging_collector=off"]
    with (directory / "postgres.log").open("ab") as errors:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=errors,
            stderr=subprocess.STDOUT,
            cwd=directory,
            start_new_session=True,
            user=account,
            group=account,
            extra_groups=None if account is None else [],
        )
    return PostgresServer(process, port, directory, binaries)


def postgres_sections(bench: Bench) -> None:
    """Report (m) to (p) for the postgres backend, measured against a postgres of our own."""
    try:
        server = start_postgres()
    except (Unavailable, OSError) as err:
        section("(m) to (p) PostgreSQL: skipped")
        row("postgres backend", f"skipped: {err}")
        return
    bench.postgres = server
    try:
        sections = (
            postgres_startup_section,
            postgres_handoff_section,
            postgres_idle_section,
            postgres_fifo_section,
        )
        for run in sections:
            timed(bench, run)
    finally:
        bench.postgres = None
        server.stop()


def postgres_server(bench: Bench) -> PostgresServer:
    """Return the running server of the PostgreSQL sections."""
    if bench.postgres is None:
        msg = "no postgres is running"
        raise Broken(msg)
    return bench.postgres


def postgres_startup_section(bench: Bench) -> None:
    """Report (m): `lockrun --uri postgresql://… -- true` against importing click and psycopg."""
    runs = bench.plan.postgres_startup_runs
    server = postgres_server(bench)
    section(f"(m) PostgreSQL startup: median wall time of {runs} runs each")
    try:
        row("server", f"postgres {server.version()}, {server.uri}")
    except Broken as err:
        bench.broke("postgres startup", err)
        return
    row("server start", f"{server.ready_in:.1f} s: a fresh cluster, then a session")
    target = make_target(bench, "postgres", bench.scenario_dir("startup-postgres"))
    lockrun, drivers, click = (
        "lockrun --uri postgresql://… -- true",
        "python -c 'import click, psycopg'",
        "python -c 'import click'",
    )
    commands = {
        lockrun: target.argv(bench.lockrun, ["true"]),
        drivers: [sys.executable, "-c", "import click, psycopg"],
        click: [sys.executable, "-c", "import click"],
    }
    medians = startup_medians(bench, commands, runs, "postgres startup")
    if medians is None:
        return
    ratio = medians[lockrun] / medians[drivers]
    row(
        "lockrun / import click, psycopg",
        f"{ratio:5.2f}x",
        f"<= {STARTUP_TARGET}x",
        verdict(ratio <= STARTUP_TARGET),
    )
    row("lockrun / import click", f"{medians[lockrun] / medians[click]:5.2f}x")


def postgres_handoff_section(bench: Bench) -> None:
    """Report (n): handoff latency through PostgreSQL over TCP (and a socket), against flock(1)."""
    trials = bench.plan.postgres_handoff_trials
    section(f"(n) PostgreSQL handoff: holder's command exits -> waiter's starts, {trials} trials")
    labels: dict[Kind, str] = {
        "postgres": "lockrun, postgres backend (TCP)",
        "postgres-socket": "lockrun, postgres backend (socket)",
        "flock": "flock(1) on a file",
    }
    if not bench.plan.postgres_socket:
        del labels["postgres-socket"]
    results, broken = handoff_trials(bench, labels, trials)
    postgres_ms, flock_ms = results["postgres"], results["flock"]
    if "postgres" not in broken:
        row(labels["postgres"], describe_tail(postgres_ms))
        slowest = "  ".join(f"{value:.2f}" for value in sorted(postgres_ms, reverse=True)[:3])
        row("postgres: slowest three", f"{slowest} ms")
    if "postgres-socket" not in labels:
        row("postgres backend (socket)", "skipped with --quick")
    elif "postgres-socket" not in broken:
        row(labels["postgres-socket"], describe_tail(results["postgres-socket"]))
    if "flock" not in broken:
        row(labels["flock"], describe_ms(flock_ms))
    if not {"postgres", "flock"} & broken:
        server_verdict("postgres", postgres_ms, statistics.median(flock_ms))


def postgres_idle_section(bench: Bench) -> None:
    """Report (o): idle waiters' and server's CPU, sessions and drain, N = 1 and 3."""
    waiters, window = bench.plan.postgres_idle_waiters, bench.plan.postgres_idle_window
    section(
        f"(o) PostgreSQL idle waiters: {waiters} waiters (-w forever) on a held name, "
        f"{window:.0f} s"
    )
    for slots in (1, 3):
        result = idle_case(bench, "postgres", slots, waiters, window)
        if result is None or result.server is None:
            continue
        what = f"--slots {slots}"
        children = result.processes - waiters
        idle_row(f"{what}: {waiters} waiters + children", result.usage, window)
        per_waiter = f"{result.usage.run * 1000 / waiters:.3f} ms CPU (exact), "
        per_waiter += f"{result.usage.switches / waiters:.1f} wakeups; {children} children"
        row(f"{what}: per waiter", per_waiter)
        server = result.server
        idle_row(f"{what}: postgres, same window", server.usage, window)
        # lockrun sets client_connection_check_interval to 1 s (14+): each backend waiting
        # on a lock wakes once a second to see if its client is still connected, so the
        # server's cost grows with the queue.
        each = f"{server.usage.run * 1000 / waiters / window:.3f} ms CPU/s, "
        each += f"{server.usage.switches / waiters / window:.2f} wakeups/s"
        row(f"{what}: postgres per waiter", each)
        # One session per waiter, and N - 1 more for the head, which waits on every slot.
        theirs, expected = server.connected - slots, waiters + slots - 1
        holders = "1 holder" if slots == 1 else f"{slots} holders"
        numbers = f"{server.connected} = {theirs} + {holders}; {server.blocked} waiting"
        row(f"{what}: sessions", numbers, f"<= {expected}", verdict(theirs <= expected))
        drained = f"all {waiters} ran in {result.drain:.2f} s; {result.left} sessions left"
        row(f"{what}: after release, drain", drained)


def postgres_fifo_section(bench: Bench) -> None:
    """Report (p): FIFO order through PostgreSQL, with one slot and with three."""
    section(f"(p) PostgreSQL FIFO: {fifo_setup(bench)}")
    fifo_cases(bench, POSTGRES_SCENARIOS)


# -- main ----------------------------------------------------------------------------------


def find_lockrun() -> list[str]:
    """Return the lockrun command next to this interpreter, else ``python -m lockrun``."""
    script = Path(sys.executable).parent / "lockrun"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "lockrun"]


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


def header(bench: Bench, quick: bool) -> None:
    """Print when, where and what was measured."""
    version = subprocess.run(
        [*bench.lockrun, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    print("lockrun benchmark" + (" (--quick)" if quick else ""))
    print("=" * WIDTH)
    print(f"date     {time.strftime('%Y-%m-%d %H:%M:%S %z')}")
    print(f"kernel   {platform.release()} on {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"python   {platform.python_version()} ({sys.executable})")
    print(f"lockrun  {version} ({shlex.join(bench.lockrun)})")
    print(f"bytecode {compile_bytecode()}")
    print(f"flock    {FLOCK}")
    print(f"load     {load_average()} (other work on the machine skews every number)")
    print("columns: what, numbers, target, verdict (no target: for reference)")


def load_average() -> str:
    """Return the 1, 5 and 15 minute load averages as text."""
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def summary(bench: Bench, began: float) -> int:
    """Print the problems, if any; return the exit status."""
    print(f"\nfinished in {time.monotonic() - began:.1f} s; load {load_average()}")
    if not bench.problems:
        return 0
    print("\nPROBLEMS (lockrun or the bench broke; reproduce with the command shown)")
    for problem in bench.problems:
        print(f"  - {problem}")
    return 1


def run_sections(bench: Bench, quick: bool, sections: Iterable[Callable[[Bench], None]]) -> None:
    """Print the header and every section."""
    header(bench, quick)
    for run in sections:
        timed(bench, run)


def timed(bench: Bench, run: Callable[[Bench], None]) -> None:
    """Run one section and print how long it took."""
    began = time.monotonic()
    run(bench)
    print(f"  ({time.monotonic() - began:.1f} s, load {load_average()})")
    sys.stdout.flush()


def stop_on_term(signo: int, _frame: FrameType | None) -> NoReturn:
    """Turn TERM and HUP into SystemExit, so the finally blocks stop what we started."""
    raise SystemExit(128 + signo)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every section once and print the report."""
    for signo in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signo, stop_on_term)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke)")
    quick = parser.parse_args(argv).quick
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="lockrun-bench-"))
    bench = Bench(find_lockrun(), root, QUICK if quick else FULL)
    try:
        sections = (startup_section, handoff_section, idle_section, fifo_section)
        run_sections(bench, quick, sections)
        redis_sections(bench)
        mysql_sections(bench)
        postgres_sections(bench)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return summary(bench, began)


if __name__ == "__main__":
    sys.exit(main())
