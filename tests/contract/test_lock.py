"""What a lock does on every backend: exclusion, slots, waits, FIFO, fences, kills, the API.

Each scenario runs once per backend of the registry (the `uri` fixture); the semantics are
docs/design.md's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Final

import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lockrun import ConfigError, ExitCode, Lease, Lock, LockBusy, UsageError
from lockrun.errors import LeaseLost
from lockrun.uri import parse_uri, redact
from tests.support.cli import (
    LOCKRUN,
    TEST_TTL,
    Held,
    finish,
    gone,
    interval_log,
    lock_state,
    lockrun,
    one_line,
    queue_length,
    start,
    unmeasured,
    wait_for,
)
from tests.support.harness import on_valkey_too
from tests.support.net import HOST, ME, server_locks, timed_lockrun

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.support.harness import Harness


# However slow a shared CI machine is, a refusal must not take this long (nor --wait's 30 s).
PATIENCE = 15.0
UNTIL = "while [ ! -e"  # a shell loop that ends once a file appears


def queued_alive(uri: str, name: str, waiters: list[subprocess.Popen[str]]) -> bool:
    """Return whether all *waiters* queue for *name*; fail at once if one has exited."""
    for waiter in waiters:
        if waiter.poll() is not None:
            _, err = waiter.communicate()
            pytest.fail(f"waiter pid {waiter.pid} exited {waiter.returncode}: {err}")
    return queue_length(uri, name) == len(waiters)


def test_second_holder_is_refused(uri: str, name: str, held: Callable[..., Held]) -> None:
    """A second lockrun on a held name exits 75 at once and names the holder."""
    holder = held("--uri", uri, "-n", name)
    result = lockrun("--uri", uri, "-n", name, "--", "true")
    assert result.returncode == 75
    assert result.stderr.startswith(f"lockrun: {name} busy, held by ")
    assert f"pid {holder.process.pid}" in result.stderr
    assert result.stderr.count("\n") == 1
    assert holder.finish() == 0


@on_valkey_too
def test_slots_admit_n_and_refuse_the_next(uri: str, name: str, held: Callable[..., Held]) -> None:
    """--slots 3 admits three holders in distinct slots and refuses a fourth."""
    holders = [held("--uri", uri, "-n", name, "-s", "3") for _ in range(3)]
    assert sorted(holder.slot for holder in holders) == [0, 1, 2]
    result = lockrun("--uri", uri, "-n", name, "-s", "3", "--", "true")
    assert result.returncode == 75
    assert "all 3 slots" in result.stderr
    assert [holder.finish() for holder in holders] == [0, 0, 0]
    assert lockrun("--uri", uri, "-n", name, "-s", "3", "--", "true").returncode == 0


def test_wait_gives_up_after_the_duration(uri: str, name: str, held: Callable[..., Held]) -> None:
    """--wait 0.3 on a held lock exits 75 saying how long it waited."""
    holder = held("--uri", uri, "-n", name)
    result = lockrun("--uri", uri, "-n", name, "-w", "0.3", "--", "true")
    assert result.returncode == 75
    assert "gave up after 0.30s" in result.stderr
    holder.finish()


def test_waiter_runs_once_the_holder_is_done(
    uri: str, name: str, held: Callable[..., Held], tmp_path: Path
) -> None:
    """A --wait forever waiter runs its command as soon as the holder releases."""
    holder = held("--uri", uri, "-n", name)
    mark = tmp_path / "ran"
    waiter = start("--uri", uri, "-n", name, "-w", "forever", "--", "touch", str(mark))
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter to queue")
    assert not mark.exists()
    holder.finish()
    assert finish(waiter) == 0
    assert mark.exists()


@on_valkey_too
def test_fence_increases_with_every_acquisition(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """LOCKRUN_FENCE strictly increases across acquisitions and hand-overs."""
    fences = []
    for _ in range(3):
        holder = held("--uri", uri, "-n", name)
        fences.append(holder.fence)
        holder.finish()
    first = held("--uri", uri, "-n", name)
    second = start(
        *("--uri", uri, "-n", name, "-w", "forever", "--", "sh", "-c"),
        "echo $LOCKRUN_FENCE",
        stdout=subprocess.PIPE,
    )
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter to queue")
    fences.append(first.fence)
    first.finish()
    out, _ = second.communicate(timeout=30)
    fences.append(int(out))
    assert fences == sorted(set(fences))


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 3])
def test_waiters_are_served_in_arrival_order(
    uri: str, name: str, held: Callable[..., Held], tmp_path: Path, slots: int
) -> None:
    """Ten queued waiters are granted strictly first-in first-out, for a mutex and N=3."""
    options = ("--uri", uri, "-n", name, "-s", str(slots))
    holders = [held(*options) for _ in range(slots)]
    waiters = []
    for index in range(10):
        script = (
            f"touch {tmp_path}/in-{index}; {UNTIL} {tmp_path}/out-{index} ]; do sleep 0.05; done"
        )
        waiters.append(start(*options, "-w", "forever", "--", "sh", "-c", script))
        # Queue each waiter before the next arrives: arrival order is then unambiguous.
        wait_for(functools.partial(queued_alive, uri, name, waiters), what=f"waiter {index}")
    granted: list[int] = []

    def next_grant() -> int:
        fresh: list[int] = []

        def appeared() -> bool:
            fresh[:] = [
                i for i in range(10) if i not in granted and (tmp_path / f"in-{i}").exists()
            ]
            return bool(fresh)

        wait_for(appeared, what="the next grant")
        assert len(fresh) == 1, f"two waiters granted at once: {fresh}"
        return fresh[0]

    for holder in holders:
        holder.finish()
        granted.append(next_grant())
    while len(granted) < 10:
        (tmp_path / f"out-{granted[len(granted) - slots]}").touch()
        granted.append(next_grant())
    for index in range(10):
        (tmp_path / f"out-{index}").touch()
    assert [finish(waiter) for waiter in waiters] == [0] * 10
    assert granted == list(range(10))


# Read, pause, write: without the lock, two of these interleave and an update is lost.
# Plain sh, not Python: PROCESSES × RUNS runs per backend, and the interpreter's start-up
# would be most of the test's time.
COUNTER = 'v=$(cat "$1"); sleep 0.001; echo $((v + 1)) > "$1.tmp"; mv "$1.tmp" "$1"'
PROCESSES: Final = 8
RUNS: Final = 6  # each: 48 runs a backend, eight at a time


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_counter_loses_no_update(uri: str, name: str, tmp_path: Path) -> None:
    """PROCESSES × RUNS read-increment-write cycles under the lock lose no update."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    script = tmp_path / "increment.sh"
    script.write_text(COUNTER)
    locked = shlex.join([*LOCKRUN, "--uri", uri, "-n", name, "-w", "forever", "--"])
    loop = f"for i in $(seq {RUNS}); do {locked} sh {script} {counter} || exit 1; done"
    workers = [subprocess.Popen(["sh", "-c", loop], env=unmeasured()) for _ in range(PROCESSES)]
    assert [worker.wait(300) for worker in workers] == [0] * PROCESSES
    assert counter.read_text().strip() == str(PROCESSES * RUNS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_semaphore_never_exceeds_its_slots(uri: str, name: str, tmp_path: Path) -> None:
    """With --slots 3, an interval log never shows more than 3 at once, and shows 3."""
    runs, slots, peak = interval_log(tmp_path, ("--uri", uri, "-n", name), slots=3, rounds=4)
    assert slots <= {0, 1, 2}
    assert runs == 32
    assert peak == 3


FIRST_STILL_RUNNING = """
import sys
pid = int(open(sys.argv[1]).read())
try:
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
except FileNotFoundError:
    state = "gone"
print("overlap" if state not in {"Z", "X", "gone"} else "alone")
"""


@pytest.mark.slow  # Redis: ~5 s, the killed holder's lease (LOCKRUN_TTL 5) must run out
@pytest.mark.parametrize("close", [False, True], ids=["inherited", "close"])
def test_killed_holder_never_lets_a_second_command_overlap(
    uri: str, name: str, tmp_path: Path, close: bool
) -> None:
    """After SIGKILL of a holding lockrun, no second command starts while the first runs.

    With --close (no inherited fd) the guardian kills the command; a backend whose lock is
    no file descriptor refuses --close as a usage error.
    """
    if close and not parse_uri(uri).kind.inherits_fds:
        result = lockrun("--uri", uri, "-n", name, "--close", "--", "true")
        assert result.returncode == ExitCode.USAGE
        assert "--close applies to the file: backend only" in one_line(result.stderr)
        return
    pid_file, go = tmp_path / "first.pid", tmp_path / "go"
    publish = f"echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}"
    script = f"{publish}; {UNTIL} {go} ]; do sleep 0.05; done"
    close_option = ["--close"] if close else []
    # stderr not piped: a surviving command would hold the pipe open.
    first = start("--uri", uri, "-n", name, *close_option, "--", "sh", "-c", script, stderr=None)
    try:
        wait_for(pid_file.exists, what="the first command")
        first_command = int(pid_file.read_text())
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        checker = tmp_path / "check.py"
        checker.write_text(FIRST_STILL_RUNNING)
        second = start(
            *("--uri", uri, "-n", name, "-w", "forever", "--", sys.executable),
            *(str(checker), str(pid_file)),
            stdout=subprocess.PIPE,
        )
        if not gone(first_command):  # it kept the inherited lock fd: it must finish first
            go.touch()
        out, _ = second.communicate(timeout=30)
        assert second.returncode == 0
        assert out.strip() == "alone"
        go.touch()
        wait_for(lambda: gone(first_command), what="the first command to end")
    finally:
        go.touch()  # whatever failed, no loop is left running


def test_python_api_holds_and_reports_slot_and_fence(uri: str, name: str) -> None:
    """`with Lock(...)` holds a slot, exposes slot and fence, and releases on exit."""
    with Lock(name, uri=uri, slots=2) as first, Lock(name, uri=uri, slots=2) as second:
        assert {first.slot, second.slot} == {0, 1}
        assert first.fence is not None
        assert second.fence is not None
        assert second.fence > first.fence
        with pytest.raises(LockBusy), Lock(name, uri=uri, slots=2):
            pass
    with Lock(name, uri=uri, slots=2, wait=None) as again:
        assert again.slot == 0


def test_python_api_decorator_serialises_calls(uri: str, name: str) -> None:
    """@Lock(...) holds the lock for each call; an inner attempt finds it busy."""

    @Lock(name, uri=uri)
    def guarded() -> str:
        try:
            with Lock(name, uri=uri):
                return "not exclusive"
        except LockBusy:
            return "exclusive"

    assert guarded() == "exclusive"
    assert guarded() == "exclusive"


def test_release_is_idempotent(uri: str, name: str) -> None:
    """Releasing a lease twice is harmless, and the slot is free afterwards."""
    lock = Lock(name, uri=uri)
    lease = lock.acquire()
    lease.release()
    lease.release()
    lock.release()
    with Lock(name, uri=uri) as lease:
        assert lease.slot == 0


def test_api_check_after_release_says_the_lease_holds_nothing(uri: str, name: str) -> None:
    """lease.check() passes while held and raises LeaseLost once released (docs/api.md)."""
    lock = Lock(name, uri=uri, slots=2)
    with lock as lease:
        lease.check()
    with pytest.raises(LeaseLost, match=f"^{name}: released"):
        lease.check()
    lease = lock.acquire()
    lease.check()
    lock.release()
    with pytest.raises(LeaseLost, match="released"):
        lease.check()
    with Lock(name, uri=uri, slots=2) as other:  # another holder's lease is not the old one's
        other.check()
        with pytest.raises(LeaseLost):
            lease.check()


def test_command_that_cannot_start_releases_the_lock(uri: str, name: str) -> None:
    """A missing command exits 127 and leaves the lock free."""
    result = lockrun("--uri", uri, "-n", name, "--", "/nonexistent/command")
    assert result.returncode == 127
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


@pytest.mark.slow
def test_lock_is_held_from_another_python_process(uri: str, name: str, tmp_path: Path) -> None:
    """The Python API and the CLI exclude each other."""
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import pathlib, time
        from lockrun import Lock
        with Lock({name!r}, uri={uri!r}, ttl={TEST_TTL}):
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(30)
    """)
    process = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_for(ready.exists, what="the API holder")
        assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 75
    finally:
        process.kill()
        process.wait()
    assert lockrun("--uri", uri, "-n", name, "-w", "10", "--", "true").returncode == 0
    assert os.environ.get("LOCKRUN_NAME") is None


def test_python_api_threads_release_their_own_slots(uri: str, name: str) -> None:
    """One Lock used from two threads: a release gives back the releasing thread's slot."""
    lock = Lock(name, uri=uri, slots=2)
    mine = lock.acquire()
    theirs: list[int] = []
    acquired, done = threading.Event(), threading.Event()

    def other() -> None:
        theirs.append(lock.acquire().slot)
        acquired.set()
        done.wait(30)
        lock.release()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert acquired.wait(30)
        lock.release()  # ours, not the other thread's more recent one
        with Lock(name, uri=uri, slots=2) as again:
            assert again.slot == mine.slot
            with pytest.raises(LockBusy), Lock(name, uri=uri, slots=2):
                pass
    finally:
        done.set()
        thread.join(30)
    assert theirs == [1 - mine.slot]


def read_line_with(process: subprocess.Popen[str], text: str, timeout: float = 20) -> list[str]:
    """Read *process*'s stderr line by line until one contains *text*; return the lines."""
    assert process.stderr is not None
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"no line with {text!r} in {lines}"
    return lines


@pytest.mark.slow
def test_verbose_waiter_names_each_holder_and_its_place(
    uri: str, name: str, held: Callable[..., Held], tmp_path: Path
) -> None:
    """Without a terminal, -v prints plain lines: the holder and place, again on each change."""
    first = held("--uri", uri, "-n", name)
    go = tmp_path / "go-second"
    loop = f"{UNTIL} {go} ]; do sleep 0.05; done"
    second = start("--uri", uri, "-n", name, "-w", "forever", "--", "sh", "-c", loop)
    wait_for(lambda: queue_length(uri, name) == 1, what="the second to queue")
    waiter = start("--uri", uri, "-n", name, "-w", "forever", "-v", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 2, what="the verbose waiter to queue")
    first.finish()
    seen = read_line_with(waiter, f"held by {HOST}:{second.pid} since ")
    go.touch()
    assert finish(second) == 0
    _, rest = waiter.communicate(timeout=30)
    assert waiter.returncode == 0
    lines = [line.rstrip("\n") for line in seen] + rest.splitlines()
    since = r"since \d\d:\d\d:\d\d"
    assert re.fullmatch(
        rf"lockrun: waiting for {name} \({re.escape(redact(uri))}\) — held by "
        rf"{HOST}:{first.process.pid}"
        rf" {since} — 1 ahead of you",
        lines[0],
    ), lines
    # A read in the middle of the handover may catch a moment with no holder on record.
    changes, done = lines[1:-2], lines[-2:]
    assert all(line.startswith(f"lockrun: waiting for {name} — ") for line in changes), lines
    assert re.fullmatch(
        rf"lockrun: waiting for {name} — held by {HOST}:{second.pid} {since} — next in line",
        changes[-1],
    ), lines
    assert done[0].startswith(f"lockrun: acquired {name} slot 0 of 1 after ")
    assert done[1].startswith(f"lockrun: released {name} after ")
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", "\n".join(lines))  # cron mails it


def test_names_of_255_bytes_lock_and_show_in_status(uri: str, held: Callable[..., Held]) -> None:
    """A name too long for a file or socket name is hashed, and still excludes and shows."""
    name = "ü" * 120 + "-" + "x" * 14  # 255 bytes
    holder = held("--uri", uri, "-n", name)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 75
    other = name[:-1] + "y"  # same long prefix, another lock
    assert lockrun("--uri", uri, "-n", other, "--", "true").returncode == 0
    status = lockrun("status", "--uri", uri, name)
    assert status.stdout.splitlines()[1].startswith(name)
    assert "holding" in status.stdout
    holder.finish()


@pytest.mark.slow  # Redis: ~5 s, the killed holder's lease (LOCKRUN_TTL 5) must run out
def test_a_queued_waiter_gets_in_when_the_holder_is_killed(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """SIGKILL of a holding lockrun lets the queued waiter in once its command is gone."""
    holder = held("--uri", uri, "-n", name)
    waiter = start("--uri", uri, "-n", name, "-w", "forever", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter")
    holder.process.kill()
    holder.go.touch()  # file: the command kept the inherited lock; let it end
    assert finish(waiter) == 0
    holder.process.communicate(timeout=10)


def test_one_shot_try_behind_a_queue_is_busy(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """With every slot taken and a waiter queued, --wait 0 is busy, not queued."""
    holders = [held("--uri", uri, "-n", name, "-s", "2") for _ in range(2)]
    waiter = start("--uri", uri, "-n", name, "-s", "2", "-w", "forever", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 1, what="the head of the queue")
    assert lockrun("--uri", uri, "-n", name, "-s", "2", "--", "true").returncode == 75
    for holder in holders:
        holder.finish()
    assert finish(waiter) == 0


class HolderThread:
    """A holder of *name* in a thread of this process until `go` is set: a busy lock."""

    def __init__(self, uri: str, name: str) -> None:
        """Take the lock in a thread; return once it is held."""
        self.go = threading.Event()
        self.held = threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(uri, name), daemon=True)
        self.thread.start()
        assert self.held.wait(PATIENCE)

    def _hold(self, uri: str, name: str) -> None:
        with Lock(name, uri=uri):
            self.held.set()
            self.go.wait(PATIENCE * 2)  # longer than any wait of a test

    def finish(self) -> None:
        """Release, and wait for the thread."""
        self.go.set()
        self.thread.join(PATIENCE * 2)


@contextlib.contextmanager
def application_timer(seconds: float, handler: Callable[[], None]) -> Iterator[list[float]]:
    """Arm ITIMER_REAL with a SIGALRM handler of the application's; yield when it ran.

    What was there before (pytest-timeout's, say) is put back afterwards.
    """
    ran: list[float] = []

    def on_alarm(_signo: int, _frame: object) -> None:
        ran.append(time.monotonic())
        handler()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    before = signal.getitimer(signal.ITIMER_REAL)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield ran
        assert signal.getsignal(signal.SIGALRM) is on_alarm  # still the application's
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *before)


def test_api_timed_wait_leaves_the_applications_timer_alone(uri: str, name: str) -> None:
    """While Lock(wait=…) waits, the application's ITIMER_REAL fires on time and its handler runs.

    The handler frees the lock: the wait ends with the grant only if the timer fired.
    """
    holder = HolderThread(uri, name)
    armed = time.monotonic()
    try:
        with application_timer(0.2, holder.go.set) as ran:
            with Lock(name, uri=uri, wait=PATIENCE) as lease:  # hang guard: LockBusy
                assert lease.slot == 0
            assert len(ran) == 1
            assert ran[0] >= armed + 0.2
    finally:
        holder.finish()


def test_api_timed_wait_times_out_and_leaves_the_timer_armed(uri: str, name: str) -> None:
    """Lock(wait=0.3) on a busy lock raises LockBusy; the application's timer still counts down."""
    holder = HolderThread(uri, name)
    try:
        with application_timer(3600, lambda: None) as ran:
            with pytest.raises(LockBusy, match=r"gave up after 0\.30s"):
                Lock(name, uri=uri, wait=0.3).acquire()
            left, _ = signal.getitimer(signal.ITIMER_REAL)
            assert 0 < left <= 3600
            assert ran == []
    finally:
        holder.finish()


def test_api_timed_wait_off_the_main_thread_leaves_the_timer_alone(uri: str, name: str) -> None:
    """A worker's timed wait: the main thread's timer fires, and its handler frees the lock."""
    holder = HolderThread(uri, name)
    outcome: list[int | None] = []

    def worker() -> None:
        with Lock(name, uri=uri, wait=PATIENCE) as lease:
            outcome.append(lease.slot)

    try:
        with application_timer(0.2, holder.go.set) as ran:
            waiter = threading.Thread(target=worker)
            waiter.start()
            waiter.join(PATIENCE * 2)  # the handler runs here, in the main thread
            assert outcome == [0]
            assert len(ran) == 1
    finally:
        holder.finish()


def _signal_state() -> tuple[object, ...]:
    """Return what a library must leave alone: every signal's handler, the mask, the timers."""
    handlers = {signo: signal.getsignal(signo) for signo in signal.valid_signals()}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    timers = [signal.getitimer(which)[1] for which in (signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)]
    return handlers, mask, timers


def test_api_leaves_the_processes_signals_and_timers_alone(uri: str, name: str) -> None:
    """A wait, a grant, check(), a renewal, a release with a window: no handler, mask or timer."""
    holder = HolderThread(uri, name)
    try:
        with application_timer(3600, lambda: None) as ran:
            before = _signal_state()
            with pytest.raises(LockBusy):
                Lock(name, uri=uri, wait=0.3).acquire()
            holder.finish()
            window = 0.1 if "hold-at-least" in parse_uri(uri).kind.modes else 0
            with Lock(name, uri=uri, wait=PATIENCE, hold_at_least=window) as lease:
                lease.check()
                lease.renew()
            assert _signal_state() == before
            left, _ = signal.getitimer(signal.ITIMER_REAL)
            assert 0 < left <= 3600
            assert ran == []
    finally:
        holder.finish()


def test_api_timed_wait_is_woken_by_a_flock_let_go_without_a_close(
    file_uri: str, name: str
) -> None:
    """file:: a flock let go by LOCK_UN, its file still open, lets a timed wait in."""
    with Lock(name, uri=file_uri):  # makes the directory and NAME.lock
        pass
    path = file_uri.removeprefix("file://") + f"/{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        timer = threading.Timer(0.2, fcntl.flock, (fd, fcntl.LOCK_UN))
        timer.start()
        with Lock(name, uri=file_uri, wait=PATIENCE) as lease:
            assert lease.slot == 0
        timer.join()
    finally:
        os.close(fd)


def test_timed_waits_work_outside_the_main_thread(uri: str, name: str) -> None:
    """Lock(wait=…) from a worker thread times out, and succeeds once the lock is free."""
    outcome: list[str] = []

    def worker(wait: float) -> None:
        try:
            with Lock(name, uri=uri, wait=wait):
                outcome.append("acquired")
        except LockBusy:
            outcome.append("busy")

    with Lock(name, uri=uri):
        thread = threading.Thread(target=worker, args=(0.3,))
        thread.start()
        thread.join(30)
    thread = threading.Thread(target=worker, args=(5,))
    thread.start()
    thread.join(30)
    assert outcome == ["busy", "acquired"]


def test_refreshes_that_succeed_keep_the_command_running(uri: str, name: str) -> None:
    """With a short --ttl the lease is checked many times while the command runs."""
    result = lockrun("--uri", uri, "-n", name, "--ttl", "1", "--", "sleep", "1.5")
    assert (result.returncode, result.stderr) == (0, "")


def test_in_a_pipeline_the_terminal_stays_with_the_pipeline() -> None:
    """In `lockrun … | cat` lockrun's group holds cat too, so the terminal is not handed over."""
    inner = f"{sys.executable} -m lockrun --uri abstract:pty -- sh -c 'ps -o stat= -p $$' | cat"
    pid, master = pty.fork()
    if pid == 0:  # pragma: no cover - the child execs at once
        os.execvp("sh", ["sh", "-c", inner])  # noqa: S606 - the test's own fixed command
    output = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 1024)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # Without the hand-over the command runs in a background group: no '+' in its state.
    assert b"+" not in output.strip()


def test_api_lease_outlives_its_ttl_while_the_block_runs(uri: str, name: str) -> None:
    """A block that runs for several ttls keeps the lock: leases and sessions are renewed."""
    with Lock(name, uri=uri, ttl=1) as lease:
        time.sleep(2.5)
        with pytest.raises(LockBusy), Lock(name, uri=uri, ttl=1):
            pass
        assert lease.fence is not None
    with Lock(name, uri=uri, ttl=1) as lease:
        assert lease.slot == 0


def test_api_release_stops_renewing(uri: str, name: str) -> None:
    """A block longer than ttl/3 is renewed by a thread; leaving it stops and joins that thread.

    Only a lease or a server session needs one; a local lock has none to stop.
    """
    renewed = not parse_uri(uri).kind.local
    before = set(threading.enumerate())
    with Lock(name, uri=uri, ttl=1):
        time.sleep(0.6)  # the first renewal is due at ttl/3
        started = {thread.name for thread in set(threading.enumerate()) - before}
        assert ("lockrun-renewer" in started) == renewed
    started = {thread.name for thread in set(threading.enumerate()) - before}
    assert "lockrun-renewer" not in started


def test_api_a_forked_child_leaves_the_parents_connections_alone(
    shared_server_harness: Harness, name: str
) -> None:
    """A forked child that exits normally, finalizers and all, leaves the parent's lock held.

    The parent holds one lock and keeps an idle connection of another: afterwards its lease
    is still proven on the server, and its next acquire works. The child's own try opens
    its own connection and finds the lock busy.
    """
    uri = shared_server_harness.uri
    script = textwrap.dedent(f"""
        import gc, os, sys
        from lockrun import Lock, LockBusy
        lock, other = Lock({name!r}, uri={uri!r}), Lock({name!r} + "-2", uri={uri!r})
        other.acquire(); other.release()  # an idle kept connection too
        lease = lock.acquire()
        pid = os.fork()
        if pid == 0:
            try:
                Lock({name!r}, uri={uri!r}).acquire()
                sys.exit(3)
            except LockBusy:
                pass
            del lock, other, lease
            gc.collect()
            sys.exit(0)  # an interpreter exit: every finalizer runs
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        lease._lease.refresh()  # proven on the server: the session is ours still
        lock.release()
        with other:
            pass
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr


def _sockets() -> set[str]:
    """Return the kernel's names (socket:[inode]) of the sockets this process has open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


def test_api_keeps_its_connection_across_acquisitions(
    shared_server_harness: Harness, name: str
) -> None:
    """A Lock connects once per thread: every acquisition after the first uses that socket.

    Counted by the kernel, not by lockrun: the sockets the process has open while it holds.
    """
    lock = Lock(name, uri=shared_server_harness.uri, wait=None)
    before = _sockets()
    seen = []
    for _ in range(5):
        with lock as lease:
            assert lease.slot == 0
            seen.append(_sockets() - before)
    assert len(seen[0]) >= 1
    assert all(opened == seen[0] for opened in seen), seen
    lock.close()
    assert not _sockets() - before


def test_api_reconnects_after_the_server_dropped_its_connection(
    server_harness: Harness, name: str
) -> None:
    """A kept connection the server dropped (a restart) is replaced at the next acquire."""
    lock = Lock(name, uri=server_harness.uri, wait=5)
    with lock:
        pass
    server_harness.restart()
    with lock as lease:
        assert lease.slot == 0
        with pytest.raises(LockBusy), Lock(name, uri=server_harness.uri):
            pass


@pytest.mark.slow
def test_api_a_waiter_on_a_kept_connection_rides_out_a_restart(
    server_harness: Harness, name: str
) -> None:
    """Queued on a kept connection when the server restarts: the wait goes on, as any does.

    The restart takes the holder's lock too (etcd keeps leases across it: the holder then
    keeps it until its release); the waiter gets it once the server is back, rather than
    giving up at once as for a kept connection that was dead before its use.
    """
    lock = Lock(name, uri=server_harness.uri, wait=60, ttl=10)
    with ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(lambda: lock.acquire().release()).result()  # its kept connection
        holder = Lock(name, uri=server_harness.uri)
        holder.acquire()
        waiting = worker.submit(lambda: lock.acquire().slot)
        wait_for(lambda: lock_state(server_harness.uri, name)["waiters"], what="the waiter")
        server_harness.restart(outage=1.0)
        with contextlib.suppress(LeaseLost):  # lost in the restart, but on etcd
            holder.release()
        assert waiting.result(timeout=60) == 0
        worker.submit(lock.release).result()


def test_api_a_thread_acquiring_what_it_holds_is_refused_at_once(uri: str, name: str) -> None:
    """Locks are not reentrant: the same Lock again, or a mutex's wait on itself, is a UsageError.

    With wait=None it would wait for itself for ever; a try (wait 0) through another Lock
    finds the lock busy, as any other holder's.
    """
    lock = Lock(name, uri=uri, wait=None)
    with lock:
        started = time.monotonic()
        with pytest.raises(UsageError, match="not reentrant"):
            lock.acquire()
        with pytest.raises(UsageError, match="wait for itself"):
            Lock(name, uri=uri, wait=None).acquire()
        with pytest.raises(LockBusy):
            Lock(name, uri=uri).acquire()
        assert time.monotonic() - started < 60  # a hang guard: waiting for itself is for ever
        outcome: list[str] = []
        thread = threading.Thread(target=lambda: outcome.append(_try(lock)))
        thread.start()
        thread.join(30)
        assert outcome == ["busy"]  # another thread is another holder
    with pytest.raises(UsageError, match="holds no slot"):
        lock.release()
    with lock as lease:
        assert lease.slot == 0
    lock.acquire().release()  # a lease released by itself, from any thread, is not held
    with lock as lease, ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(lease.release).result()
    with Lock(name, uri=uri, wait=None) as lease:
        assert lease.slot == 0


def _try(lock: Lock) -> str:
    """Return what one try of *lock*'s name (wait 0, its slots and mode) from this thread gives."""
    try:
        with Lock(lock.name, uri=lock.uri, slots=lock.slots, shared=lock.shared):
            return "acquired"
    except LockBusy:
        return "busy"


def test_api_check_reports_a_lost_lease_inside_the_block(
    server_harness: Harness, name: str
) -> None:
    """lease.check() raises LeaseLost within the block once a renewal found the lease gone.

    Leaving the block raises it again.
    """
    lock = Lock(name, uri=server_harness.uri, ttl=1.5)
    lease = lock.acquire()
    lease.check()  # held: nothing to say
    server_harness.end_session(name)
    deadline = time.monotonic() + 10
    lost = None
    while lost is None and time.monotonic() < deadline:
        try:
            lease.check()
        except LeaseLost as err:
            lost = err
        time.sleep(0.05)
    assert lost is not None
    with pytest.raises(LeaseLost):
        lock.release()
    with Lock(name, uri=server_harness.uri) as lease:
        lease.check()


def test_api_a_lock_refused_for_its_slots_acquires_once_they_agree(uri: str, name: str) -> None:
    """A refused N (78) leaves the Lock's kept connection usable: it acquires once N is free.

    Slot 0 free, slot 1 held with N = 3: the one-slot Lock's first try takes slot 0, whose
    release kept the session that the refusal then hung up on; the next acquire used it.
    """
    first, second = Lock(name, uri=uri, slots=3), Lock(name, uri=uri, slots=3)
    first.acquire()
    second.acquire()
    first.release()
    one = Lock(name, uri=uri, wait=0.2)
    with ThreadPoolExecutor(max_workers=1) as worker:  # its own thread: one connection
        for _ in range(2):
            with pytest.raises(ConfigError, match="in use with 3 slots"):
                worker.submit(one.acquire).result()
        second.release()
        assert worker.submit(lambda: one.acquire().slot).result() == 0
        worker.submit(one.release).result()


def what_holds(uri: str, name: str) -> object:
    """Return what holds *name*: status's holders, and the server's own locks where asked."""
    holders = [(entry["slot"], entry["pid"]) for entry in lock_state(uri, name)["holders"]]
    return holders, server_locks(uri, "default", name)  # and no session's lock left behind


@pytest.mark.slow
@pytest.mark.parametrize(
    ("held_slots", "other_slots"),
    [("3", ["1", "2"]), ("1", ["3", "2"])],
    ids=["semaphore-then-fewer", "mutex-then-semaphore"],
)
def test_a_slots_mismatch_exits_78_naming_the_holder(
    uri: str, held: Callable[..., Held], name: str, held_slots: str, other_slots: list[str]
) -> None:
    """Another --slots than a live holder's: 78 naming it, at once even with --wait; none left."""
    holder = held("--uri", uri, "-n", name, "-s", held_slots)
    before = what_holds(uri, name)
    for slots in other_slots:
        # One that waited its hour out would fail timed_lockrun's 60 s: 78 within it is at once.
        for wait in ("0", "3600"):
            result, _ = timed_lockrun(
                "--uri", uri, "-n", name, "-s", slots, "-w", wait, "--", "echo", "ran"
            )
            assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
            line = one_line(result.stderr)
            held_as = "1 slot" if held_slots == "1" else f"{held_slots} slots"
            asked = "1 slot" if slots == "1" else f"{slots} slots"
            assert f"in use with {held_as} by {ME}@{HOST} pid {holder.process.pid}" in line
            assert f"but this one asks for {asked};" in line
    assert what_holds(uri, name) == before  # the refused tries took no other slot
    same = lockrun("--uri", uri, "-n", name, "-s", held_slots, "--", "printenv", "LOCKRUN_SLOT")
    if held_slots == "1":
        assert same.returncode == ExitCode.BUSY
    else:
        assert (same.returncode, same.stdout) == (0, "1\n"), same.stderr
    assert holder.process.poll() is None  # the holder runs on, untouched
    assert holder.finish() == 0
    for slots in other_slots:  # once the name is free, the other N works
        after = lockrun("--uri", uri, "-n", name, "-s", slots, "--", "true")
        assert after.returncode == 0, after.stderr


def test_namespaces_partition_names(uri: str, held: Callable[..., Held], name: str) -> None:
    """One name in namespaces a and b: both run; a second user of a's is busy (75).

    Where locks are server sessions' locks, the holder's is a's alone: a failed try in b
    leaves nothing.
    """
    namespace = f"a-{uuid.uuid4().hex[:8]}"
    holder = held("--uri", uri, "-n", name, "--namespace", namespace)
    other = lockrun("--uri", uri, "-n", name, "--namespace", "b", "--", "printenv", "LOCKRUN_NAME")
    assert (other.returncode, other.stdout, other.stderr) == (0, f"{name}\n", "")
    same = lockrun("--uri", uri, "-n", name, "--namespace", namespace, "--", "echo", "ran")
    assert (same.returncode, same.stdout) == (ExitCode.BUSY, "")
    assert name in one_line(same.stderr)
    environment = {**os.environ, "LOCKRUN_NAMESPACE": namespace}
    also_same = lockrun("--uri", uri, "-n", name, "--", "true", env=environment)
    assert also_same.returncode == ExitCode.BUSY
    assert name in lockrun("status", "--uri", uri, "--namespace", namespace).stdout
    assert name not in lockrun("status", "--uri", uri, "--namespace", "b").stdout
    if (locks := server_locks(uri, namespace, name)) is not None:
        assert [lock[:2] for lock in locks] == [("0", True)]
        assert server_locks(uri, "b", name) == []
    assert holder.finish() == 0


def test_a_name_over_255_bytes_is_a_usage_error(uri: str) -> None:
    """Names may have up to 255 bytes: 300 characters exit 64 before any connection."""
    result = lockrun("--uri", uri, "-n", "n" * 300, "--", "echo", "ran")
    assert (result.returncode, result.stdout) == (ExitCode.USAGE, "")
    assert "300 bytes" in one_line(result.stderr)


def test_api_reports_a_lease_lost_while_the_block_ran(server_harness: Harness, name: str) -> None:
    """The lease or session taken during the block: leaving it raises LeaseLost; name free.

    (On Redis the keys go with a FLUSHALL; on MySQL and PostgreSQL the session is killed.)
    """
    lock = Lock(name, uri=server_harness.uri, ttl=1.5)
    lock.acquire()
    server_harness.end_session(name)
    time.sleep(1.5)  # more than ttl/3: a renewal or a check has found it gone
    with pytest.raises(LeaseLost, match=server_harness.lost_reason or "lease is gone"):
        lock.release()
    with Lock(name, uri=server_harness.uri) as lease:
        assert lease.slot == 0


# -- Lock(reentrant=True): the oracle is another process (the CLI) or another thread's try --


def _cli_try(uri: str, name: str) -> int:
    """Return the exit status of one `lockrun` try of *name* from another process."""
    return lockrun("--uri", uri, "-n", name, "--", "true").returncode


def _try_elsewhere(uri: str, name: str, *, slots: int = 1, shared: bool = False) -> str:
    """Return what one try of *name* by a new Lock in another thread gives."""
    with ThreadPoolExecutor(max_workers=1) as other:
        return other.submit(_try, Lock(name, uri=uri, slots=slots, shared=shared)).result()


def test_api_a_reentrant_lock_is_released_by_its_outermost_release_only(
    uri: str, name: str
) -> None:
    """Nested acquisitions of a reentrant Lock share one lease; only the outermost exit frees it.

    Another process finds the lock busy at depth 2 and again after the inner exit; free after
    the outer one. Another Lock object of this thread is refused or busy, as without reentry.
    """
    lock = Lock(name, uri=uri, reentrant=True, wait=None)
    with lock as outer:
        with lock as inner:
            assert inner is outer
            assert lock.acquire() is outer  # acquire() nests as `with` does
            lock.release()
            assert _cli_try(uri, name) == ExitCode.BUSY
            with pytest.raises(UsageError, match="wait for itself"):
                Lock(name, uri=uri, reentrant=True, wait=None).acquire()
            with pytest.raises(LockBusy):
                Lock(name, uri=uri, reentrant=True).acquire()
        assert _cli_try(uri, name) == ExitCode.BUSY  # the inner exit gave nothing back
        outer.check()
        assert lock.acquire().fence == outer.fence
        lock.release()
    with pytest.raises(LeaseLost, match="released"):
        outer.check()
    assert _cli_try(uri, name) == 0
    with pytest.raises(UsageError, match="holds no slot"):
        lock.release()
    with lock as again:  # a new acquisition: a new lease
        assert again is not outer
        assert again.fence is not None
        assert outer.fence is not None
        assert again.fence > outer.fence


def test_api_a_reentrant_decorator_nests_in_recursion(uri: str, name: str) -> None:
    """A recursive function under @Lock(reentrant=True) holds one slot at every depth."""
    lock = Lock(name, uri=uri, reentrant=True)
    seen: list[str] = []

    @lock
    def descend(depth: int) -> None:
        with ThreadPoolExecutor(max_workers=1) as other:  # another thread: another holder
            seen.append(other.submit(_try, lock).result())
        if depth:
            descend(depth - 1)

    descend(2)
    assert seen == ["busy"] * 3
    assert _try(lock) == "acquired"


def test_api_a_reentrant_lock_takes_one_slot_of_a_semaphore(uri: str, name: str) -> None:
    """Re-entering a slot of a 2-slot semaphore takes no second slot; status shows one holder."""
    lock = Lock(name, uri=uri, slots=2, reentrant=True)
    with lock as outer, lock, lock as inner:
        assert inner is outer
        assert len(lock_state(uri, name)["holders"]) == 1
        with Lock(name, uri=uri, slots=2) as other:  # the one free slot
            assert other.slot == 1 - outer.slot
            assert _try_elsewhere(uri, name, slots=2) == "busy"
    assert lock_state(uri, name)["holders"] == []


def test_api_a_reentrant_shared_lock_nests_and_shares(uri: str, name: str) -> None:
    """A shared reentrant Lock nests on its one shared hold: readers get in, a writer does not."""
    if "shared" not in parse_uri(uri).kind.modes:
        pytest.skip(f"{parse_uri(uri).scheme}: declines --shared (Scheme.modes)")
    lock = Lock(name, uri=uri, shared=True, reentrant=True)
    with lock as outer, lock as inner:
        assert inner is outer
        assert len(lock_state(uri, name)["holders"]) == 1
        assert _try_elsewhere(uri, name, shared=True) == "acquired"
        assert _try_elsewhere(uri, name) == "busy"
    assert _try_elsewhere(uri, name) == "acquired"


def test_api_a_reentrant_lock_makes_other_threads_wait_for_the_outermost_release(
    uri: str, name: str
) -> None:
    """Another thread using the same reentrant Lock waits until the holder's last exit.

    It may not release what it does not hold, and gets its own, new lease. (It waits for
    ever, in flock(2) on file:, where a timed wait of the API keeps no place in the queue.)
    """
    lock = Lock(name, uri=uri, reentrant=True, wait=None)
    granted = threading.Event()
    leases = []

    def other() -> None:
        with pytest.raises(UsageError, match="holds no slot"):
            lock.release()
        with lock as lease:
            leases.append(lease)
            granted.set()

    with lock as outer:
        with lock:
            thread = threading.Thread(target=other, daemon=True)  # daemon: should it hang
            thread.start()
            wait_for(lambda: _queued_here(uri, name), what="the other thread to queue")
        assert _try_elsewhere(uri, name) == "busy"  # time enough for a wrong grant to show
        assert not granted.is_set()
    assert granted.wait(PATIENCE)
    thread.join(PATIENCE)
    assert leases[0] is not outer


def _queued_here(uri: str, name: str) -> bool:
    """Return whether a thread of this process waits for *name*.

    `lockrun status` lists it, except on file:, where a waiter of the holder's pid is the
    holder to status; there the kernel's /proc/locks shows this pid blocked in flock(2).
    """
    if queue_length(uri, name) == 1:
        return True
    with open("/proc/locks") as locks:
        return any(
            line.split()[1] == "->" and line.split()[5] == str(os.getpid()) for line in locks
        )


class _Probe:
    """Another thread's try of a name, through a Lock of its own that keeps its connection."""

    def __init__(self, uri: str, name: str, thread: ThreadPoolExecutor) -> None:
        self.lock = Lock(name, uri=uri)
        self.thread = thread

    def busy(self) -> bool:
        """Return whether the try found the name busy (and let it go if it got it)."""
        return self.thread.submit(self._attempt).result()

    def _attempt(self) -> bool:
        try:
            self.lock.acquire()
        except LockBusy:
            return True
        self.lock.release()
        return False


class _Nesting(RuleBasedStateMachine):
    """A reentrant Lock in random nestings against a model; a `_Probe` is the oracle.

    The model keeps one entry per acquisition not yet released and which leases are held.
    """

    lock: Lock
    probe: _Probe

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[Lease] = []  # outermost first
        self.live: set[int] = set()  # id() of the leases held

    @rule()
    def enter(self) -> None:
        lease = self.lock.acquire()
        top = self.pending[-1] if self.pending else None
        if top is not None and id(top) in self.live:
            assert lease is top
        else:
            assert lease is not top
            self.live.add(id(lease))
        self.pending.append(lease)

    @precondition(lambda self: self.pending)
    @rule()
    def leave(self) -> None:
        self.lock.release()
        lease = self.pending.pop()
        if all(outer is not lease for outer in self.pending):
            self.live.discard(id(lease))

    @precondition(lambda self: self.pending)
    @rule()
    def release_the_lease(self) -> None:
        self.pending[-1].release()  # at once, whatever the depth
        self.live.discard(id(self.pending[-1]))

    @invariant()
    def busy_while_held(self) -> None:
        assert self.probe.busy() == bool(self.live)

    def teardown(self) -> None:
        while self.pending:
            self.leave()


def test_api_reentrant_nesting_matches_a_model(uri: str, name: str) -> None:
    """Random nestings, exits and direct lease releases: busy to another thread iff held."""
    with ThreadPoolExecutor(max_workers=1) as thread:

        class Nesting(_Nesting):
            lock = Lock(name, uri=uri, reentrant=True)
            probe = _Probe(uri, name, thread)

        run_state_machine_as_test(
            Nesting, settings=settings(max_examples=10, stateful_step_count=10, deadline=None)
        )
        assert not Nesting.probe.busy()


def test_api_a_forked_child_does_not_nest_on_its_parents_hold(uri: str, name: str) -> None:
    """In a child forked by a holder, re-entering the reentrant Lock is a UsageError.

    The parent's hold goes on: it nests again afterwards, and a try from another thread and
    another Lock is busy until the parent's outermost release.
    """
    script = textwrap.dedent(f"""
        import os, threading
        from lockrun import Lock, LockBusy, UsageError
        def busy():
            found = []
            def try_it():
                try:
                    Lock({name!r}, uri={uri!r}).acquire().release()
                    found.append(False)
                except LockBusy:
                    found.append(True)
            thread = threading.Thread(target=try_it); thread.start(); thread.join()
            return found == [True]
        lock = Lock({name!r}, uri={uri!r}, reentrant=True)
        lock.acquire()
        pid = os.fork()
        if pid == 0:
            try:
                lock.acquire()
                os._exit(3)
            except UsageError as err:
                os._exit(0 if "forked" in str(err) else 4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        lock.acquire(); lock.release()
        assert busy()
        lock.release()
        assert not busy()
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr


def test_api_a_reentrant_lock_reports_a_lost_lease_at_every_level(
    shared_server_harness: Harness, name: str
) -> None:
    """A lease lost while nested: re-entering raises LeaseLost, and so does each exit.

    The name is free afterwards.
    """
    uri = shared_server_harness.uri
    lock = Lock(name, uri=uri, ttl=1.5, reentrant=True)
    lease = lock.acquire()
    assert lock.acquire() is lease
    shared_server_harness.end_session(name)
    deadline = time.monotonic() + 10  # a hang guard: a renewal finds it within ttl/3
    while True:
        try:
            lease.check()
        except LeaseLost:
            break
        assert time.monotonic() < deadline, "check() never reported the lost lease"
        time.sleep(0.05)
    with pytest.raises(LeaseLost):
        lock.acquire()  # not taken again: the depth stays 2
    with pytest.raises(LeaseLost):
        lock.release()
    with pytest.raises(LeaseLost):
        lock.release()
    with pytest.raises(UsageError, match="holds no slot"):
        lock.release()
    with Lock(name, uri=uri) as again:
        again.check()
