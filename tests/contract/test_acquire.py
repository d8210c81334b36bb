"""One lock across several steps: `lockrun acquire`, `release` and `renew` on every backend.

Each scenario runs once per backend (the `uri` fixture). The keeper is judged by what other
lockruns find (busy, free), by `lockrun status`, and by the processes themselves, never by
its own word alone (docs/semantics.md "Holding a lock across steps").
"""

from __future__ import annotations

import itertools
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

import pytest

from lockrun import Lock
from lockrun.uri import SCHEMES, parse_uri
from tests.support.cli import (
    LOCKRUN,
    TEST_TTL,
    finish,
    gone,
    lock_state,
    lockrun,
    one_line,
    queue_length,
    start,
    taken,
    unmeasured,
    wait_for,
)
from tests.support.harness import on_valkey_too, shared_harness_for

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.harness import Harness

SLACK = 5.0  # Python start-ups on a loaded 2-core machine
BIN = str(Path(sys.executable).parent)  # where this venv's `lockrun` script is


@pytest.fixture
def owner() -> Iterator[subprocess.Popen[bytes]]:
    """Return a process to own keepers; killed at teardown, which releases what they hold."""
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def acquire(uri: str, name: str, owner: int | str, *options: str) -> str:
    """Run `lockrun acquire` to its end and return the token it printed."""
    result = lockrun("acquire", "--uri", uri, "--owner", str(owner), *options, name)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    token = result.stdout.strip()
    assert result.stdout == f"{token}\n"
    return token


def keeper_pid(uri: str, name: str) -> int:
    """Return the pid `lockrun status` names as the holder of *name*."""
    (holder,) = lock_state(uri, name)["holders"]
    return int(holder["pid"])


def free(uri: str, name: str) -> bool:
    """Whether *name* is free now (asked in this process: no start-up to wait for)."""
    return not taken(uri, name)


def time_to_free(uri: str, name: str, patience: float) -> float:
    """Return when (`time.monotonic`) a Lock of our own got *name*, waiting up to *patience*."""
    lock = Lock(name, uri=uri, wait=patience, ttl=float(TEST_TTL))
    try:
        with lock:
            return time.monotonic()
    finally:
        lock.close()


@on_valkey_too
def test_a_keeper_holds_the_lock_across_steps_until_release(
    uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """acquire: busy for others, shown by status as the keeper; release frees it; twice is 76."""
    token = acquire(uri, name, owner.pid)
    busy = lockrun("--uri", uri, "-n", name, "--", "true")
    assert busy.returncode == 75
    pid = keeper_pid(uri, name)
    assert f"pid {pid}" in one_line(busy.stderr)
    assert "acquire" in lock_state(uri, name)["holders"][0]["argv"]
    assert not gone(pid)
    renewed = lockrun("renew", token)
    assert (renewed.returncode, renewed.stderr) == (0, "")
    released = lockrun("release", "-v", token)
    assert released.returncode == 0
    assert one_line(released.stderr).startswith(f"lockrun: released {name} after ")
    wait_for(lambda: gone(pid), what="the keeper to exit")
    assert free(uri, name)
    again = lockrun("release", token)
    assert again.returncode == 76
    assert "no keeper holds a lock for this token" in one_line(again.stderr)


def test_the_owners_exit_releases_the_lock(
    uri: str, name: str, owner: subprocess.Popen[bytes], record: Callable[..., None]
) -> None:
    """A keeper releases as its owner exits; the next holder gets in within milliseconds."""
    acquire(uri, name, owner.pid)
    pid = keeper_pid(uri, name)
    exited = time.monotonic()
    owner.kill()
    got = time_to_free(uri, name, SLACK)
    record("owner's exit to the next holder's grant", seconds=got - exited)
    wait_for(lambda: gone(pid), what="the keeper to exit")


@on_valkey_too
def test_a_killed_keeper_frees_the_lock_as_a_killed_holder(
    uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """SIGKILL to the keeper: freed at once, or within a ttl where the lock is a lease."""
    token = acquire(uri, name, owner.pid, "--ttl", "2")
    os.kill(keeper_pid(uri, name), signal.SIGKILL)
    time_to_free(uri, name, 2 + SLACK)
    assert lockrun("release", token).returncode == 76


def test_a_take_over_ends_the_keeper_and_release_says_79(
    uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """A --take-over run gets a keeper's lock; the script's release then exits 79, naming it."""
    if "take-over" not in (parsed := parse_uri(uri)).kind.modes:
        pytest.skip(f"{parsed.scheme}: declines --take-over (Scheme.modes)")
    token = acquire(uri, name, owner.pid)
    taker = lockrun("--uri", uri, "-n", name, "--take-over", "-w", "30", "--", "true")
    assert (taker.returncode, taker.stderr) == (0, "")
    released = lockrun("release", token)
    assert released.returncode == 79
    assert one_line(released.stderr).startswith(f"lockrun: {name}: taken over by ")


def test_a_lost_lease_is_told_by_renew_and_release(
    shared_server_harness: Harness, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """The server ends the keeper's session (or lease): renew and release exit 76, saying so."""
    uri = shared_server_harness.uri
    token = acquire(uri, name, owner.pid, "--ttl", TEST_TTL)
    shared_server_harness.end_session(name)
    renewed = lockrun("renew", token)
    assert renewed.returncode == 76
    line = one_line(renewed.stderr)
    assert line.startswith(f"lockrun: {name}: ")
    released = lockrun("release", token)
    assert (released.returncode, released.stderr) == (76, renewed.stderr)


def test_max_time_releases_and_renew_counts_it_again(
    file_uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """--max-time ends the hold unless renewed, counted from the renewal; then 124 is told."""
    token = acquire(file_uri, name, owner.pid, "--max-time", "2")
    began = time.monotonic()
    time.sleep(0.5)
    asked = time.monotonic()
    renewed = lockrun("renew", "-v", token)
    answered = time.monotonic()
    assert renewed.returncode == 0, renewed.stderr
    assert "held, until" in one_line(renewed.stderr)
    time.sleep(max(0.0, began + 2.2 - time.monotonic()))  # past the first --max-time
    if time.monotonic() < asked + 2:  # not a machine so loaded that this says nothing
        assert taken(file_uri, name)
    got = time_to_free(file_uri, name, SLACK)
    assert asked + 2 <= got <= answered + 2 + SLACK
    late = lockrun("renew", token)
    assert late.returncode == 124
    assert "--max-time 2s expired" in one_line(late.stderr)
    assert lockrun("release", token).returncode == 124
    assert lockrun("release", token).returncode == 76  # the keeper told it and left


def test_a_signal_while_waiting_leaves_nothing(
    file_uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """TERM to acquire while it waits: 143, one line, no keeper; SIGKILL: no keeper either."""
    token = acquire(file_uri, name, owner.pid)
    for signo, status in ((signal.SIGTERM, 143), (signal.SIGKILL, -9)):
        waiter = start("acquire", "--uri", file_uri, "-w", "forever", name, stdout=subprocess.PIPE)
        wait_for(lambda: queue_length(file_uri, name) == 1, what="the keeper to queue")
        waiter.send_signal(signo)
        out, err = waiter.communicate(timeout=30)
        assert (waiter.returncode, out) == (status, "")
        if status > 0:
            assert f"TERM while waiting for {name}; nothing is held" in one_line(err)
        wait_for(lambda: queue_length(file_uri, name) == 0, what="the keeper to leave the queue")
    assert lockrun("release", token).returncode == 0


def test_a_token_that_cannot_be_written_releases_the_lock(file_uri: str, name: str) -> None:
    """Acquire whose stdout is a pipe nobody reads exits 74, and nothing stays held."""
    read, write = os.pipe()
    os.close(read)
    result = subprocess.run(
        [*LOCKRUN, "acquire", "--uri", file_uri, name],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )
    os.close(write)
    assert result.returncode == 74
    assert "released the lock" in one_line(result.stderr)
    assert free(file_uri, name)


# The exclusion oracle: each step appends its own interval while it believes it holds the lock.
STEP = """
eval "$(lockrun acquire --uri "$1" --owner $$ --export -w forever "$2")"
start=$(date +%s%N)
sleep 0.05
echo "$start $(date +%s%N)" >> "$3"
lockrun release
"""


@pytest.mark.parametrize("backend", ["postgres"])  # a server: sessions, a keeper's renewals
def test_steps_that_acquire_and_release_never_overlap(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, name: str
) -> None:
    """Two loops of acquire / log an interval / release: no two intervals overlap."""
    server = None if SCHEMES[backend].local else request.getfixturevalue(f"{backend}_uri")
    uri = shared_harness_for(backend, tmp_path, server).uri
    log, script = tmp_path / "intervals", tmp_path / "step.sh"
    script.write_text(STEP)
    loop = f"for i in 1 2; do sh {script} {shlex.join([uri, name, str(log)])} || exit 1; done"
    env = unmeasured() | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    workers = [subprocess.Popen(["sh", "-c", loop], env=env) for _ in range(2)]
    assert [worker.wait(120) for worker in workers] == [0, 0]
    intervals = sorted(tuple(map(int, line.split())) for line in log.read_text().splitlines())
    assert len(intervals) == 4
    for (_, end), (begin, _) in itertools.pairwise(intervals):
        assert end <= begin, intervals


# A script section, as docs/semantics.md and the README give it, in a function, under set -e.
SECTION = """
set -e
section() {{
  eval "$(lockrun acquire --uri {uri} --owner $$ --export {name})"
  if lockrun --uri {uri} -n {name} -- true 2>/dev/null; then exit 9; fi
  echo "$LOCKRUN_TOKEN" > {token}
  lockrun release
}}
section
lockrun --uri {uri} -n {name} -- true
TOKEN=$(lockrun acquire --uri {uri} {name} 2>/dev/null)  # bash forks a subshell for this
touch {ready}
sleep 600
"""


@pytest.mark.parametrize("shell", ["bash", "dash", "zsh"])
def test_a_shell_section_holds_the_lock_and_a_killed_script_frees_it(
    shell: str, file_uri: str, name: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    """The documented recipe in bash, dash and zsh; SIGKILL to the script frees its lock."""
    ready, token = tmp_path / "ready", tmp_path / "token"
    script = SECTION.format(uri=file_uri, name=name, token=token, ready=ready)
    env = unmeasured() | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        process = subprocess.Popen(
            [shell, "-c", script], env=env, stderr=stderr, start_new_session=True
        )
    wait_for(lambda: ready.exists() or process.poll() is not None, what="the script")
    assert process.poll() is None, errors.read_text()
    assert token.read_text().startswith("lr1.")
    # `TOKEN=$(lockrun acquire … 2>/dev/null)`: owned by the script's shell, not by the
    # subshell bash forks for the redirection, which exits with the acquire.
    assert not free(file_uri, name)
    killed = time.monotonic()
    os.killpg(process.pid, signal.SIGKILL)  # the script's group, as timeout(1) or a CI cancel
    process.wait(30)
    assert errors.read_text() == ""
    record(
        f"{shell} killed to the next holder's grant",
        seconds=time_to_free(file_uri, name, SLACK) - killed,
    )


def test_a_busy_acquire_exits_with_the_conflict_exit_code_even_0(
    file_uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """-E 0 on a busy lock: status 0, the busy line, no token, and nothing held of its own."""
    acquire(file_uri, name, owner.pid)
    busy = lockrun("acquire", "--uri", file_uri, "--owner", str(owner.pid), "-E", "0", name)
    assert (busy.returncode, busy.stdout) == (0, "")
    assert f"{name} busy" in one_line(busy.stderr)
    assert len(lock_state(file_uri, name)["holders"]) == 1


def test_usr1_to_a_waiting_acquire_is_dropped_and_it_waits_on(
    file_uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """USR1 and USR2 while waiting are dropped, as for a run: the acquire keeps its place."""
    token = acquire(file_uri, name, owner.pid)
    waiting = start(
        "acquire", "--uri", file_uri, "--owner", str(owner.pid), "-w", "60", name,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    wait_for(lambda: queue_length(file_uri, name) == 1, what="the acquire to queue")
    waiting.send_signal(signal.SIGUSR1)
    waiting.send_signal(signal.SIGUSR2)
    assert lockrun("release", token).returncode == 0
    out, err = waiting.communicate(timeout=30)
    assert (waiting.returncode, err) == (0, ""), err
    assert lockrun("release", out.strip()).returncode == 0


def test_a_crowd_at_the_door_only_delays_the_owners_release(
    file_uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """A full backlog (the keeper stopped, a crowd queued) delays release; it never fails it.

    The crowd stays at the door once the keeper runs again: it takes 8 of them (CLIENTS)
    until they say nothing for 2 s (PATIENCE) and turns the rest away as busy, the release
    among them, which asks again (a CI run at load 8 got "hung up without an answer").
    """
    token = acquire(file_uri, name, owner.pid)
    keeper = keeper_pid(file_uri, name)
    door = b"\0lockrun-keeper/" + token.split(".")[2].encode()
    crowd = []
    os.kill(keeper, signal.SIGSTOP)
    try:
        while True:  # fill the backlog: a connect that would wait is refused at once (EAGAIN)
            knock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            knock.setblocking(False)  # noqa: FBT003 - the socket API
            crowd.append(knock)
            try:
                knock.connect(door)
            except BlockingIOError:
                break
        release = start("release", token)
        time.sleep(0.5)  # the release knocks meanwhile, and must not give up
        assert release.poll() is None
        os.kill(keeper, signal.SIGCONT)
        _, said = release.communicate(timeout=60)
    finally:
        os.kill(keeper, signal.SIGCONT)
        for knock in crowd:
            knock.close()
    assert release.returncode == 0, said
    assert free(file_uri, name)


def test_a_shell_started_by_a_shell_of_the_same_command_line_owns_its_lock(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """Not a subshell: `bash -c S` run by `bash -c S` owns the lock, freed when it exits."""
    done = tmp_path / "done"
    script = (
        f'if [ -n "$INNER" ]; then lockrun acquire --uri {file_uri} {name} >/dev/null; exit; fi; '
        f'INNER=1 bash -c "$BASH_EXECUTION_STRING"; touch {done}; sleep 600'
    )
    env = unmeasured() | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    outer = subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True)
    try:
        wait_for(lambda: done.exists() or outer.poll() is not None, what="the inner shell")
        assert outer.poll() is None
        wait_for(lambda: free(file_uri, name), timeout=SLACK, what="the inner shell's lock")
    finally:
        os.killpg(outer.pid, signal.SIGKILL)
        outer.wait()


# A pre-fork master (multiprocessing, gunicorn) whose worker takes a lock and exits; the
# master lives on, reading stdin, until the test closes it.
FORKED_WORKER = """
import multiprocessing, os, subprocess, sys
def work():
    lockrun = [sys.executable, "-m", "lockrun", *sys.argv[2:]]
    return subprocess.run(lockrun, stdout=subprocess.DEVNULL, check=False).returncode
if __name__ == "__main__":
    if sys.argv[1] == "multiprocessing":
        worker = multiprocessing.get_context("fork").Process(target=lambda: sys.exit(work()))
        worker.start()
        worker.join()
        status = worker.exitcode
    else:
        child = os.fork()
        if child == 0:
            os._exit(work())
        status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    print(status, flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("fork", ["multiprocessing", "os.fork"])
def test_a_forked_worker_owns_its_lock(fork: str, file_uri: str, name: str) -> None:
    """A worker forked by a Python master is no subshell: its lock ends with it, not the master."""
    with subprocess.Popen(
        [sys.executable, "-c", FORKED_WORKER, fork, "acquire", "--uri", file_uri, name],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=unmeasured(),
    ) as master:  # fmt: skip
        assert master.stdin is not None
        assert master.stdout is not None
        assert master.stdout.readline() == "0\n"  # the worker took the lock and exited
        wait_for(lambda: free(file_uri, name), timeout=60, what="the worker's lock to end")
        assert master.poll() is None
        master.stdin.close()


# A section whose shell is killed by pid while a step runs: the step must end before the next
# holder starts. Each step writes when it starts, waits for the test's word, and writes when it
# ends; the foreground one is a program (its environment carries the token), the background one
# a subshell (a fork of the shell, which does not).
SECTION_STEPS = {
    "foreground": 'eval "$(lockrun acquire --uri {uri} --owner $$ --export {name})"\n'
    "sh -c {step}\n"
    "lockrun release\n",
    "background": 'eval "$(lockrun acquire --uri {uri} --owner $$ --export {name})"\n'
    "( {step_code} ) &\n"
    "wait\n"
    "lockrun release\n",
    "asks": 'eval "$(lockrun acquire --uri {uri} --owner $$ --export {name})"\n'
    "sh -c {step}' ; lockrun release 2>/dev/null; echo $? > {status}'\n"
    "exit\n",  # not the last command: bash -c would exec it in its place
    "released": 'eval "$(lockrun acquire --uri {uri} --owner $$ --export {name})"\n'
    "( {step_code} ) &\n"
    "lockrun release\n"
    "wait\n",
}
# Its poll is a fork and exec of sleep(1): every 50 ms, not 20, keeps it off the CPU; the
# order of "ended" and the next holder's start does not depend on it.
SECTION_STEP = (
    "date +%s%N > {started}; while [ ! -e {finish} ]; do sleep 0.05; done; date +%s%N > {ended}"
)


def run_section(
    shell: str, step: str, uri: str, name: str, tmp_path: Path, *, session: bool = True
) -> tuple[subprocess.Popen[bytes], dict[str, Path]]:
    """Start a script with a section of *step*; return it and its stamp files once it runs.

    With *session*, in a session of its own, as cron, systemd and a terminal start a script;
    else in the test's process group, as some CI runners do.
    """
    files = {what: tmp_path / what for what in ("started", "finish", "ended", "got", "status")}
    code = SECTION_STEP.format(**{what: shlex.quote(str(path)) for what, path in files.items()})
    script = SECTION_STEPS[step].format(
        uri=shlex.quote(uri),
        name=name,
        step=shlex.quote(code),
        step_code=code,
        status=shlex.quote(str(files["status"])),
    )
    env = unmeasured() | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    process = subprocess.Popen([shell, "-c", script], env=env, start_new_session=session)
    wait_for(files["started"].exists, what="the step to start")
    return process, files


def next_holder(uri: str, name: str, got: Path) -> subprocess.Popen[str]:
    """Start a run that waits for *name* and stamps *got* once it holds it."""
    return start(
        "--uri", uri, "-n", name, "-w", "120", "--", "sh", "-c", f"date +%s%N > {got}"
    )  # fmt: skip


def stamp(path: Path) -> int:
    """Return the nanoseconds written to *path*."""
    return int(path.read_text())


@pytest.mark.parametrize("shell", ["bash", "dash", "zsh"])
@pytest.mark.parametrize("step", ["foreground", "background"])
@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_a_section_outlives_its_killed_shell_until_its_steps_end(
    shell: str, step: str, signo: int, file_uri: str, name: str, tmp_path: Path
) -> None:
    """TERM or KILL to the script's shell by pid: the next holder starts after the step ends."""
    section_killed(shell, step, signo, file_uri, name, tmp_path)


@pytest.mark.parametrize("step", ["foreground", "background"])
def test_a_section_on_every_backend_outlives_its_killed_shell(
    step: str, uri: str, name: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    """As on file:, on every backend: a shell killed by pid keeps its lock for its steps.

    KILL only: what ends the shell is the keeper's concern, not the backend's, and the test
    above sends TERM and KILL from each shell on file:.
    """
    late = section_killed("bash", step, signal.SIGKILL, uri, name, tmp_path)
    record("the step's end to the next holder's start", seconds=late)


@pytest.mark.parametrize("step", ["foreground", "background"])
def test_a_section_in_its_starters_group_outlives_its_killed_shell(
    step: str, file_uri: str, name: str, tmp_path: Path
) -> None:
    """A script in the group of what started it (a CI runner's): its steps keep its lock too."""
    section_killed("bash", step, signal.SIGKILL, file_uri, name, tmp_path, session=False)


def section_killed(
    shell: str, step: str, signo: int, uri: str, name: str, tmp_path: Path, *, session: bool = True
) -> float:
    """Kill a section's shell by pid while its step runs; the step ends before the next holder.

    Return the seconds from the step's end to the next holder's start.
    """
    script, files = run_section(shell, step, uri, name, tmp_path, session=session)
    script.send_signal(signo)
    assert script.wait(30) == -signo
    waiter = next_holder(uri, name, files["got"])
    # Queued, or (were the lock free) already in: either way, only now may the step end.
    wait_for(lambda: queue_length(uri, name) == 1 or files["got"].exists(), what="the waiter")
    files["finish"].touch()
    assert finish(waiter, timeout=60) == 0
    wait_for(files["ended"].exists, what="the step to end")
    assert stamp(files["ended"]) <= stamp(files["got"])
    return (stamp(files["got"]) - stamp(files["ended"])) / 1e9


# A process the script started just before its acquire, then the shell killed by pid.
STARTED_BEFORE = (
    "sleep 600 & echo $! > {pid}\n"
    'eval "$(lockrun acquire --uri {uri} --owner $$ --export {name})"\n'
    "kill -KILL $$\n"
)


@pytest.mark.parametrize("shell", ["bash", "dash"])
def test_a_process_started_just_before_the_acquire_is_no_part_of_the_section(
    shell: str, file_uri: str, name: str, tmp_path: Path
) -> None:
    """Started before the acquire, even within the same clock tick (10 ms): it keeps nothing.

    Several times, since /proc counts a start in ticks: a `&` step forked a moment before
    acquire's process used to count whenever both began in one tick.
    """
    env = unmeasured() | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    for attempt in range(5):
        pid, each = tmp_path / f"pid{attempt}", f"{name}-{attempt}"
        script = STARTED_BEFORE.format(
            pid=shlex.quote(str(pid)), uri=shlex.quote(file_uri), name=each
        )
        shell_process = subprocess.Popen([shell, "-c", script], env=env, start_new_session=True)
        assert shell_process.wait(60) == -signal.SIGKILL
        early = int(pid.read_text())
        try:
            wait_for(lambda: free(file_uri, each), timeout=60, what="the lock")  # noqa: B023
            os.kill(early, 0)  # it still runs: the lock passed on without it
        finally:
            os.kill(early, signal.SIGKILL)


@pytest.mark.parametrize("shell", ["bash", "dash", "zsh"])
def test_release_in_a_section_releases_at_once_while_a_step_runs(
    shell: str, file_uri: str, name: str, tmp_path: Path
) -> None:
    """`lockrun release` is explicit: the next holder starts while the section's step runs."""
    script, files = run_section(shell, "released", file_uri, name, tmp_path)
    waiter = next_holder(file_uri, name, files["got"])
    assert finish(waiter, timeout=60) == 0
    assert not files["ended"].exists()  # the step still waits for our word
    files["finish"].touch()
    assert script.wait(30) == 0
    assert stamp(files["got"]) <= stamp(files["ended"])


# A partition is judged by what holds the lock, not by the backend: a lease (Redis) may still
# be held, a session that timed out is closed (MariaDB and PostgreSQL alike, the common
# sessionlock code). One of each: a session's case waits out its server's timeout (~10 s) on
# a server of the test's own.
LEASE_OR_SESSION: Final = pytest.mark.parametrize(
    "server_harness", ["redis", "postgres"], indirect=True
)


@LEASE_OR_SESSION
def test_renew_asks_the_server_and_says_69_when_it_cannot_answer(
    server_harness: Harness, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """`lockrun renew` in a partition: never 0 (held) without the server; 69, or 76 (lost)."""
    assert server_harness.proxied is not None
    token = acquire(server_harness.proxied, name, owner.pid, "--ttl", "10")
    renewed = lockrun("renew", token)
    assert (renewed.returncode, renewed.stderr) == (0, "")
    server_harness.partition()
    cut = lockrun("renew", token)
    line = one_line(cut.stderr)
    if server_harness.backend == "redis":  # a lease: maybe still held on the server, unknown
        assert (cut.returncode, "did not confirm the lease now" in line) == (69, True), line
    else:  # a session that timed out is closed: its locks are gone with it
        assert (cut.returncode, "session holding the lock ended" in line) == (76, True), line


@LEASE_OR_SESSION
def test_a_release_the_server_never_heard_is_not_0(
    server_harness: Harness, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """`lockrun release` in a partition: never 0 ("released") without the server.

    It said "released NAME after Xs" and 0. A lease may still be held until it runs out
    (69, saying so); a session that timed out is closed, its locks gone (76).
    """
    assert server_harness.proxied is not None
    token = acquire(server_harness.proxied, name, owner.pid, "--ttl", "10")
    server_harness.partition()
    cut = lockrun("release", token)
    line = one_line(cut.stderr)
    assert "released" not in line.split(";")[0], line
    assert cut.returncode in {69, 76}, line
    if cut.returncode == 69:
        assert "frees by itself" in line or "did not confirm" in line, line


def test_a_section_whose_lock_was_taken_over_hears_79_after_its_shell_is_killed(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """The keeper lingers for the section, not only its shell: a step's release is told 79."""
    script, files = run_section("bash", "asks", file_uri, name, tmp_path)
    taker = lockrun("--uri", file_uri, "-n", name, "--take-over", "-w", "30", "--", "true")
    assert taker.returncode == 0, taker.stderr
    script.send_signal(signal.SIGKILL)
    assert script.wait(30) == -signal.SIGKILL
    files["finish"].touch()
    wait_for(files["status"].exists, what="the step's release")
    wait_for(lambda: files["status"].read_text().strip(), what="its status")
    assert files["status"].read_text() == "79\n"
