"""The edges of a process: environment, closed streams, signals while waiting, numbers, sizes.

What a careless operator or a crontab does without meaning harm: each case ends with the
right status and one line, and leaves nothing held.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

import pytest

from lockrun.backends import RECORD_ARGV
from lockrun.uri import BACKENDS
from tests.support.cli import LOCKRUN, Held, lockrun, one_line, queue_length, start, wait_for

if TYPE_CHECKING:
    from collections.abc import Callable


def test_lockrun_version_or_help_in_the_environment_changes_no_run(
    file_uri: str, name: str
) -> None:
    """LOCKRUN_VERSION=1 (an env var like any) must not turn every run into --version."""
    env = os.environ | {"LOCKRUN_VERSION": "1", "LOCKRUN_HELP": "1"}
    result = lockrun("--uri", file_uri, "-n", name, "--", "sh", "-c", "echo ran", env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", "")


def test_an_empty_command_name_is_not_found(file_uri: str, name: str) -> None:
    """Lockrun -- "" is what a shell says of "": 127, one line."""
    result = lockrun("--uri", file_uri, "-n", name, "--", "")
    assert result.returncode == 127
    assert "command not found" in one_line(result.stderr)


# ``python -m lockrun`` as a shell command line.
LOCKRUN_SH = " ".join(LOCKRUN)


def sh(command: str) -> subprocess.CompletedProcess[str]:
    """Run *command* in sh, with LOCKRUN standing for ``python -m lockrun``."""
    argv = ["sh", "-c", command.replace("LOCKRUN", LOCKRUN_SH)]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


CLOSED_FDS = """
import os
closed = []
for fd in (0, 1, 2):  # before this opens anything, which would take the lowest free fd
    try:
        os.fstat(fd)
    except OSError:
        closed.append(str(fd))
open("{out}", "w").write(" ".join(closed))
"""


def test_closed_standard_streams_reach_no_lock_file(
    tmp_path: Path, file_uri: str, name: str
) -> None:
    """Started with fd 0, 1 and 2 closed: runs, and the command gets them closed too."""
    probe = tmp_path / "probe.py"
    probe.write_text(CLOSED_FDS.format(out=tmp_path / "closed"))
    result = sh(f"LOCKRUN --uri {file_uri} -n {name} -- {sys.executable} {probe} <&- >&- 2>&-")
    assert result.returncode == 0
    # No lock file or socket took the place of a closed stream.
    assert (tmp_path / "closed").read_text() == "0 1 2"
    # Released: the fence counter is all that is left (the record blanked), no output.
    assert re.fullmatch(rb"\d+\n *", (tmp_path / "locks" / f"{name}.lock").read_bytes())


def test_busy_with_stderr_closed_still_exits_75(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """Nobody to tell: the status still says busy."""
    holder = held("--uri", file_uri, "-n", name)
    result = sh(f"LOCKRUN --uri {file_uri} -n {name} -- true 2>&-")
    assert result.returncode == 75
    holder.finish()


def test_status_that_cannot_be_written_exits_74_in_one_line(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """Stdout closed, or a pipe whose reader is gone: 74 (EX_IOERR), one line, no traceback."""
    holder = held("--uri", file_uri, "-n", name)
    closed = sh(f"LOCKRUN status --uri {file_uri} >&-")
    assert closed.returncode == 74
    assert "cannot write to stdout: it is closed" in one_line(closed.stderr)
    reader, writer = os.pipe()
    os.close(reader)
    try:
        argv = [*LOCKRUN, "status", "--uri", file_uri]
        broken = subprocess.run(
            argv, stdout=writer, stderr=subprocess.PIPE, text=True, check=False, timeout=60
        )
    finally:
        os.close(writer)
    assert broken.returncode == 74
    assert "cannot write to stdout: Broken pipe" in one_line(broken.stderr)
    holder.finish()


# QUIT and HUP go through the one handler every backend's wait shares (lockrun.hold): on
# file: and Redis, a local wait and a server's. TERM during --wait 300d, each backend's own
# timed wait, on all five; tests/test_supervise.py sends INT to a wait on every backend.
_BY_CLASS: Final = ("file", "redis")
WAITS: Final = [
    *(
        pytest.param(signame, status, "forever", backend, id=f"{signame.lower()}-{backend}")
        for signame, status in (("QUIT", 131), ("HUP", 129))
        for backend in _BY_CLASS
    ),
    *(
        pytest.param("TERM", 143, "300d", backend, id=f"term-during-300d-{backend}")
        for backend in BACKENDS
    ),
]


@pytest.mark.parametrize(
    ("signame", "status", "wait", "shared_harness"), WAITS, indirect=["shared_harness"]
)
def test_quit_hup_or_term_while_waiting_ends_the_wait(
    uri: str, name: str, held: Callable[..., Held], signame: str, status: int, wait: str
) -> None:
    """QUIT (Ctrl-Backslash), HUP or TERM while waiting: 128+N, one line, nothing held, no core.

    --wait 300d (past what poll(2) takes in one call) is a wait on every backend, until TERM.
    """
    holder = held("--uri", uri, "-n", name)
    waiter = start("--uri", uri, "-n", name, "-w", wait, "--", "true")
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter")
    if wait == "300d":
        time.sleep(1)
        assert waiter.poll() is None, waiter.communicate()
    waiter.send_signal(signal.Signals["SIG" + signame])
    _, stderr = waiter.communicate(timeout=30)
    assert waiter.returncode == status
    assert f"SIG{signame} while waiting for {name}; nothing is held" in one_line(stderr)
    # A server drops an ended session's wait a moment later (docs/semantics.md "Faults").
    wait_for(lambda: queue_length(uri, name) == 0, timeout=2.5, what="the wait to leave")
    holder.finish()


def test_usr1_and_usr2_while_waiting_are_dropped_and_the_wait_goes_on(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """USR1/USR2 have no command to go to yet: -v says so, the waiter keeps its place."""
    holder = held("--uri", file_uri, "-n", name)
    waiter = start("-v", "--uri", file_uri, "-n", name, "-w", "forever", "--", "true")
    wait_for(lambda: queue_length(file_uri, name) == 1, what="the waiter")
    for signo in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR1):
        waiter.send_signal(signo)
    time.sleep(0.3)
    assert waiter.poll() is None
    holder.finish()
    _, stderr = waiter.communicate(timeout=30)
    assert waiter.returncode == 0
    assert "SIGUSR1 while waiting for" in stderr
    assert "dropped" in stderr


HUP_TRAP = """
import signal, sys, time, pathlib
signal.signal(signal.SIGHUP, lambda *_: pathlib.Path(sys.argv[1], "got-hup").touch())
pathlib.Path(sys.argv[1], "ready").touch()
time.sleep(1.5)
"""


def test_hup_ignored_by_the_caller_is_not_forwarded(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """Under nohup, a HUP to lockrun is not sent on to a command that handles HUP."""
    script = tmp_path / "trap.py"
    script.write_text(HUP_TRAP)
    command = f"trap '' HUP; exec {LOCKRUN_SH} --uri {file_uri} -n {name} --"
    process = subprocess.Popen(
        ["sh", "-c", f"{command} {sys.executable} {script} {tmp_path}"], stderr=subprocess.PIPE
    )
    wait_for((tmp_path / "ready").exists, what="the command")
    process.send_signal(signal.SIGHUP)
    _, stderr = process.communicate(timeout=30)
    assert (process.returncode, stderr) == (0, b"")
    assert not (tmp_path / "got-hup").exists()


def test_a_nested_lockrun_never_falls_back_to_file_silently(file_uri: str, name: str) -> None:
    """LOCKRUN_URI with a password reaches the command as ***: an inner lockrun says 78."""
    env = os.environ | {"LOCKRUN_URI": "redis://:hunter2secret@127.0.0.1:1/0"}
    inner = f"{LOCKRUN_SH} -n inner-{name} -- true"
    result = lockrun("--uri", file_uri, "-n", name, "--", "sh", "-c", inner, env=env)
    assert result.returncode == 78
    line = one_line(result.stderr)
    assert "redis://***@127.0.0.1:1/0: its password was replaced by ***" in line
    assert "hunter2" not in result.stderr


def test_a_command_line_past_64k_runs_and_is_recorded_cut(uri: str, name: str) -> None:
    """70 kB of arguments: the command runs; the record keeps about 1 kB and a marker."""
    big = ["x" * 40_000, "é" * 15_000]
    script = 'printf %s "$LOCKRUN_NAME" > "$0.ready"; while [ ! -e "$0.go" ]; do sleep 0.05; done'
    marker = Path(f"/tmp/lockrun-big-{name}")
    holder = start("--uri", uri, "-n", name, "--", "sh", "-c", script, str(marker), *big)
    try:
        wait_for(Path(f"{marker}.ready").exists, what="the command")
        listing = lockrun("status", "--uri", uri, "--json", name)
        assert listing.returncode == 0, listing.stderr
        [state] = json.loads(listing.stdout)
        [holder_record] = state["holders"]
        argv = holder_record["argv"]  # from the record, or from /proc for abstract:
        assert len(json.dumps(argv)) < 2 * RECORD_ARGV
        assert argv[-1].endswith("more characters not recorded]")
    finally:
        Path(f"{marker}.go").touch()
        _, stderr = holder.communicate(timeout=30)
        for leftover in (Path(f"{marker}.ready"), Path(f"{marker}.go")):
            leftover.unlink(missing_ok=True)
    assert (holder.returncode, stderr) == (0, "")


def test_status_escapes_what_a_terminal_would_act_on(tmp_path: Path, name: str) -> None:
    """Names and command lines with ESC, CR, bidi overrides, bad UTF-8: escaped in the table."""
    uri = f"file://{tmp_path}/locks"
    awkward = f"{name}\x1b]0;owned\x07\r\u202e"
    command = [*LOCKRUN, "--uri", uri, "-n", awkward, "--", "sh", "-c"]
    script = f"touch {tmp_path}/ready; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done"
    argv = [os.fsencode(arg) for arg in command] + [script.encode(), b"\xff\x1b[2J\xfe"]
    holder = subprocess.Popen(argv, stderr=subprocess.PIPE)
    try:
        wait_for((tmp_path / "ready").exists, what="the holder")
        for args in ([], [awkward]):
            shown = lockrun("status", "--uri", uri, *args)
            assert (shown.returncode, shown.stderr) == (0, ""), shown.stderr
            for raw in ("\x1b", "\r", "\u202e", "\x07"):
                assert raw not in shown.stdout
            assert "\\x1b]0;owned\\x07\\x0d\\u202e" in shown.stdout
            assert "\\udcff\\x1b[2J\\udcfe" in shown.stdout
            assert len(shown.stdout.splitlines()) == 2  # the header and one row: no forged row
    finally:
        (tmp_path / "go").touch()
        holder.communicate(timeout=30)
    assert holder.returncode == 0


# Every file option of every backend, FIFO and device alike: tests/unit/test_sweeps.py, in
# this process. Here, the CLI's exit once, with libpq's password file (what libpq, not
# lockrun, would read: a FIFO there would block lockrun in C, where no signal gets it out).
def test_a_fifo_as_a_uris_file_is_refused_at_once(tmp_path: Path, name: str) -> None:
    """A TLS, option or password file that is a FIFO would block its reader: 78 at once."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    uri = f"postgresql://u@127.0.0.1:1/db?passfile={path}"
    started = time.monotonic()
    result = lockrun("--uri", uri, "-n", name, "-w", "0", "--", "true", timeout=30)
    assert result.returncode == 78, result.stderr
    one_line(result.stderr)
    assert time.monotonic() - started < 20


# One backend per class of lock, and of the descriptors it takes: an fd the command inherits
# (file:), a lease renewed over a socket beside a guardian (Redis), a server session
# (PostgreSQL). Each case of the sweep is a lockrun start-up or two: on all five backends
# it was the longest test of the fast set (15 to 30 s each).
@pytest.mark.parametrize("shared_harness", ["file", "redis", "postgres"], indirect=True)
def test_too_few_descriptors_is_one_line_and_leaves_nothing_held(uri: str, name: str) -> None:
    """`ulimit -n` too small for lockrun's pipes, sockets and lock files: never 70.

    The guardian's switch, the watch's pipes and a lease's eventfds each need a descriptor;
    one that could not be had was an "internal error" (70). Whatever the limit, and however
    many descriptors the caller left open, lockrun says it in one line with 71 (EX_OSERR,
    as sysexits says of "cannot create pipe") or runs, and the lock is free afterwards.
    Below 5, the interpreter itself cannot start.
    """
    statuses = set()
    cases = [(limit, 0) for limit in range(5, 17)] + [
        (16, held) for held in range(1, 8)
    ]  # fds 3-9: sh
    for limit, held in cases:
        opened = "".join(f"exec {fd}</dev/null; " for fd in range(3, 3 + held))
        result = sh(
            f"ulimit -n {limit}; {opened}exec LOCKRUN --uri {shlex.quote(uri)} -n {name} -- true"
        )
        statuses.add(result.returncode)
        if result.returncode != 0:
            line = one_line(result.stderr)
            assert result.returncode == 71, (limit, held, line)
            assert "ulimit -n" in line, line
            # A run that failed part-way must have let go; one that ran released as usual,
            # and the next case's run would find it busy (75) if not.
            free = lockrun("--uri", uri, "-n", name, "-w", "0", "--", "true")
            assert free.returncode == 0, (limit, held, free.stderr)
    assert statuses == {0, 71}  # the cases span both
    free = lockrun("--uri", uri, "-n", name, "-w", "0", "--", "true")
    assert free.returncode == 0, free.stderr
