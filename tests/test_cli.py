"""The command line end to end: every exit status and every bad input of #2.

The statuses are those of docs/semantics.md "Exit status".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import pytest

from lockrun import ConfigError, ExitCode, Lock, LockBusy, cli
from lockrun.backends import Holder, Request, parse_uri
from lockrun.backends import file as file_backend
from lockrun.backends.directories import Default
from lockrun.cli import output
from tests.support.cli import (
    LOCKRUN,
    Held,
    lockrun,
    one_line,
    python,
    queue_length,
    start,
    wait_for,
)
from tests.support.terminal import Terminal

if TYPE_CHECKING:
    from collections.abc import Callable

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces, chown)")


# -- the statuses of docs/semantics.md "Exit status", one test each --------------------------------
# 76 (lost lock), 124 (--max-time), 128+N and INT or TERM while waiting are the supervisor's:
# tests/test_supervise.py.


@pytest.mark.parametrize("status", [0, 1, 2, 3, 64, 75, 255])
def test_the_commands_own_status_passes_through(file_uri: str, name: str, status: int) -> None:
    """The command's exit status is lockrun's, even where it equals one of lockrun's own."""
    result = lockrun("--uri", file_uri, "-n", name, "--", "sh", "-c", f"exit {status}")
    assert result.returncode == status
    assert result.stderr == ""


# Each bad option, duration, name or missing command in this process (it only feeds the
# parsers): tests/unit/test_sweeps.py. Here, one of each kind through a real process: click's
# own refusal, the parser's, and one of run's checks.
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--bogus", "--", "true"], "--bogus"),
        ([], "no command to run"),
        (["--ttl", "0", "--", "true"], "--ttl must be at least 1s and at most 1d00h, not 0s"),
        (["--close", "--uri", "abstract:", "--", "true"], "--close applies to the file:"),
    ],
)
def test_usage_errors_exit_64_with_one_line(arguments: list[str], message: str) -> None:
    """Bad options, durations, names and missing commands exit 64 with one line."""
    result = lockrun(*arguments)
    assert result.returncode == ExitCode.USAGE
    assert message in one_line(result.stderr)


def test_durations_may_be_compound_and_below_a_second(file_uri: str, name: str) -> None:
    """Every DURATION option and its variable takes 1m30s and 500ms: --max-time 300ms stops."""
    started = time.monotonic()
    result = lockrun(
        *("--uri", file_uri, "-n", name, "--wait", "1m30s", "--ttl", "2.5s"),
        *("--kill-after", "1s500ms", "--max-time", "300ms", "--", "sleep", "30"),
        env=os.environ | {"LOCKRUN_LOST_KILL_AFTER": "250ms"},
    )
    assert result.returncode == ExitCode.TIMEOUT
    assert "--max-time 0.30s expired" in one_line(result.stderr)
    assert time.monotonic() - started < 20  # not the 30 s of sleep
    refused = lockrun("-n", name, "--", "true", env=os.environ | {"LOCKRUN_WAIT": "1h1h"})
    assert refused.returncode == ExitCode.USAGE
    assert "'1h1h': units must come largest first" in one_line(refused.stderr)
    assert "(from LOCKRUN_WAIT)" in refused.stderr  # where to look for it


def on_private_tmpfs(mount: Path, size: str, then: str) -> subprocess.CompletedProcess[str]:
    """Run shell commands *then* on a fresh tmpfs at *mount* (with ``locks/``), privately."""
    mount.mkdir()
    setup = f"mount -t tmpfs -o size={size} none {mount} && mkdir {mount}/locks"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{setup} && {then}"],
        capture_output=True,
        text=True,
        check=False,
    )


@needs_root
def test_read_only_lock_directory_exits_69(tmp_path: Path, name: str) -> None:
    """A lock directory on a read-only file system is an unavailable backend (69)."""
    mount = tmp_path / "ro"
    lockrun_ = f"{sys.executable} -m lockrun --uri file://{mount}/locks -n {name} -- true"
    result = on_private_tmpfs(mount, "1m", f"mount -o remount,ro {mount} && exec {lockrun_}")
    assert result.returncode == ExitCode.UNAVAILABLE
    assert "read-only file system" in one_line(result.stderr)


@needs_root
def test_full_file_system_exits_69_and_leaves_the_lock_free(tmp_path: Path, name: str) -> None:
    """A full lock file system is an unavailable backend (69), and nothing stays locked."""
    mount = tmp_path / "full"
    locks = f"{mount}/locks"
    then = (
        f"touch {locks}/{name}.lock {locks}/{name}.fence"
        f" && (dd if=/dev/zero of={mount}/fill bs=4k count=4 2>/dev/null; true)"
        f" && {sys.executable} -m lockrun --uri file://{locks} -n {name} -- true;"
        f" echo status=$?; flock -n {locks}/{name}.lock echo free"
    )
    result = on_private_tmpfs(mount, "4k", then)
    assert "status=69" in result.stdout, result
    assert "free" in result.stdout
    assert "No space left on device" in one_line(result.stderr)


def test_internal_errors_exit_70_without_a_traceback(file_uri: str, name: str) -> None:
    """A bug becomes status 70 with one line; LOCKRUN_DEBUG=1 adds the traceback."""
    # A lease whose refresh has a bug: the command is stopped and lockrun reports 70.
    script = f"""
import lockrun.backends.file as file
def broken(self): raise RuntimeError("boom")
file.FileLease.refresh = broken
import sys
sys.argv = ["lockrun", "--uri", {file_uri!r}, "-n", {name!r}, "--ttl", "1", "--", "sleep", "30"]
from lockrun.cli import main
main()
"""
    result = python(script)
    assert result.returncode == ExitCode.SOFTWARE
    assert "internal error: RuntimeError: boom" in one_line(result.stderr)
    debug = python(script, env=os.environ | {"LOCKRUN_DEBUG": "1"})
    assert debug.returncode == ExitCode.SOFTWARE
    assert "Traceback" in debug.stderr
    assert lockrun("--uri", file_uri, "-n", name, "--", "true").returncode == 0


def test_busy_exits_75_and_minus_e_moves_it(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """A held lock gives 75, -E picks another status, -q silences only the busy line."""
    holder = held("--uri", file_uri, "-n", name)
    assert lockrun("--uri", file_uri, "-n", name, "--", "true").returncode == ExitCode.BUSY
    moved = lockrun("--uri", file_uri, "-n", name, "-E", "1", "--", "true")
    assert moved.returncode == 1
    assert "busy" in one_line(moved.stderr)
    quiet = lockrun("--uri", file_uri, "-n", name, "-q", "--", "true")
    assert (quiet.returncode, quiet.stderr) == (ExitCode.BUSY, "")
    holder.finish()


def test_a_line_break_in_a_name_keeps_messages_to_one_line(
    file_uri: str, held: Callable[..., Held]
) -> None:
    """Control characters in a name show escaped: every message stays one line."""
    name = "first\nsecond\rthird\x1b[31m\ttab"
    holder = held("--uri", file_uri, "-n", name)
    busy = lockrun("--uri", file_uri, "-n", name, "--", "true")
    assert busy.returncode == ExitCode.BUSY
    assert one_line(busy.stderr).startswith(
        "lockrun: first\\x0asecond\\x0dthird\\x1b[31m\\x09tab busy"
    )
    holder.finish()


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("redis2://host", "unknown lock URI scheme in 'redis2://host'"),
        ("nonsense", "malformed lock URI 'nonsense'"),
        ("", "malformed lock URI ''"),
        ("file://otherhost/tmp/x", "not host 'otherhost'"),
        ("http://user:hunter2@host/", "unknown lock URI scheme in 'http://***@host/'"),
    ],
)
def test_configuration_errors_exit_78(uri: str, message: str) -> None:
    """Unknown schemes and malformed URIs exit 78 with one line and no password."""
    result = lockrun("--uri", uri, "--", "true")
    assert result.returncode == ExitCode.CONFIG
    line = one_line(result.stderr)
    assert message in line
    assert "hunter2" not in line


def test_slots_mismatch_exits_78(file_uri: str, name: str, held: Callable[..., Held]) -> None:
    """A user asking for other --slots than a live holder's exits 78 naming the holder."""
    holder = held("--uri", file_uri, "-n", name, "-s", "2")
    result = lockrun("--uri", file_uri, "-n", name, "-s", "3", "--", "true")
    assert result.returncode == ExitCode.CONFIG
    line = one_line(result.stderr)
    assert f"in use with 2 slots by root@{socket.gethostname()} pid {holder.process.pid}" in line
    # One message for CLI and API users alike: it names both ways of setting N.
    assert "but this one asks for 3 slots;" in line
    assert line.endswith(
        "all users of a name must agree on its slots (--slots, or slots= in Python)"
    )
    holder.finish()


def test_lock_directory_that_is_a_symlink_exits_78(tmp_path: Path, name: str) -> None:
    """A lock directory that is a symlink is refused, not followed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = lockrun("--uri", f"file://{tmp_path}/link", "-n", name, "--", "true")
    assert result.returncode == ExitCode.CONFIG
    assert "is a symlink" in one_line(result.stderr)
    assert list((tmp_path / "real").iterdir()) == []


def test_lock_directory_that_cannot_be_created_exits_78(name: str) -> None:
    """A lock directory that cannot be made is a configuration error."""
    result = lockrun("--uri", "file:///proc/lockrun/locks", "-n", name, "--", "true")
    assert result.returncode == ExitCode.CONFIG
    assert "lock directory /proc/lockrun/locks" in one_line(result.stderr)


def test_command_not_executable_exits_126(file_uri: str, name: str, tmp_path: Path) -> None:
    """A command that exists but cannot run exits 126 and releases the lock."""
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    result = lockrun("--uri", file_uri, "-n", name, "--", str(script))
    assert result.returncode == ExitCode.CANNOT_EXECUTE
    assert "cannot execute: Permission denied" in one_line(result.stderr)
    assert lockrun("--uri", file_uri, "-n", name, "--", str(tmp_path)).returncode == 126
    assert lockrun("--uri", file_uri, "-n", name, "--", "true").returncode == 0


def test_command_not_found_exits_127(file_uri: str, name: str) -> None:
    """A command that does not exist exits 127 with one line."""
    result = lockrun("--uri", file_uri, "-n", name, "--", "no-such-command-xyz")
    assert result.returncode == ExitCode.NOT_FOUND
    assert one_line(result.stderr) == f"lockrun: {name}: no-such-command-xyz: command not found"


# -- the rest of the surface ----------------------------------------------------------------


def test_options_after_the_command_belong_to_it(file_uri: str, name: str) -> None:
    """Everything after COMMAND, even lockrun's own options, is the command's."""
    result = lockrun("--uri", file_uri, "-n", name, "echo", "-n", "--wait", "x")
    assert (result.returncode, result.stdout) == (0, "--wait x")
    dashed = lockrun("--uri", file_uri, "-n", name, "--", "echo", "--", "-v")
    assert dashed.stdout == "-- -v\n"


def test_environment_variables_set_options(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """LOCKRUN_URI, LOCKRUN_WAIT and LOCKRUN_CONFLICT_EXIT_CODE act as the options do."""
    holder = held("--uri", file_uri, "-n", name)
    env = os.environ | {
        "LOCKRUN_URI": file_uri,
        "LOCKRUN_WAIT": "0.1",
        "LOCKRUN_CONFLICT_EXIT_CODE": "9",
    }
    result = lockrun("-n", name, "--", "true", env=env)
    assert result.returncode == 9
    assert "gave up after 0.10s" in result.stderr
    holder.finish()


def test_lockrun_name_and_slots_are_not_read_back(file_uri: str, name: str) -> None:
    """A nested lockrun does not take LOCKRUN_NAME/SLOTS from its locked parent."""
    inner = (
        f"{sys.executable} -m lockrun --uri {file_uri} -- sh -c 'echo $LOCKRUN_NAME $LOCKRUN_SLOTS'"
    )
    result = lockrun("--uri", file_uri, "-n", name, "-s", "2", "--", "sh", "-c", inner)
    assert result.returncode == 0, result.stderr
    inner_name, inner_slots = result.stdout.split()
    assert inner_name.startswith("sh-")
    assert inner_slots == "1"


def test_command_environment(file_uri: str, name: str) -> None:
    """The command sees LOCKRUN_NAME, SLOT, SLOTS and FENCE, and a URI with no password."""
    env = os.environ | {
        "LOCKRUN_URI": "file://user:secret@localhost/tmp/x",
        "LOCKRUN_FENCE": "stale",
    }
    result = lockrun("--uri", file_uri, "-n", name, "-s", "2", "--", "env", env=env)
    seen = dict(
        line.split("=", 1) for line in result.stdout.splitlines() if line.startswith("LOCKRUN_")
    )
    assert seen["LOCKRUN_NAME"] == name
    assert (seen["LOCKRUN_SLOT"], seen["LOCKRUN_SLOTS"]) == ("0", "2")
    assert int(seen["LOCKRUN_FENCE"]) > 0
    assert seen["LOCKRUN_URI"] == "file://***@localhost/tmp/x"


def test_default_name_is_derived_from_the_command(file_uri: str) -> None:
    """Without --name the lock is the basename plus an argv hash, shown by -v."""
    first = lockrun("--uri", file_uri, "-v", "--", "sh", "-c", "echo $LOCKRUN_NAME")
    again = lockrun("--uri", file_uri, "--", "sh", "-c", "echo $LOCKRUN_NAME")
    other = lockrun("--uri", file_uri, "--", "sh", "-c", "echo $LOCKRUN_NAME ")
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout
    assert first.stdout.startswith("sh-")
    assert f"lock name {first.stdout.strip()} (derived" in first.stderr


def test_verbose_reports_waiting_acquiring_and_releasing(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """-v says who holds the lock while waiting, then acquired and released."""
    holder = held("--uri", file_uri, "-n", name)
    waiter = start("--uri", file_uri, "-n", name, "-v", "-w", "forever", "--", "true")
    wait_for(lambda: queue_length(file_uri, name) == 1, what="the waiter")
    holder.finish()
    _, stderr = waiter.communicate(timeout=30)
    lines = stderr.splitlines()
    held_by = f"held by {os.uname().nodename}:{holder.process.pid} since "
    assert lines[0].startswith(f"lockrun: waiting for {name} ({file_uri}) — {held_by}")
    assert lines[0].endswith(" — next in line")
    assert lines[1].startswith(f"lockrun: acquired {name} slot 0 of 1 after ")
    assert lines[2].startswith(f"lockrun: released {name} after ")
    assert "\x1b" not in stderr


def test_version_and_help() -> None:
    """-V prints the version and -h the usage, both with status 0."""
    version = lockrun("-V")
    assert (version.returncode, version.stdout.split()[0]) == (0, "lockrun,")
    usage = lockrun("-h")
    assert usage.returncode == 0
    assert "--conflict-exit-code" in usage.stdout
    assert lockrun("status", "--help").returncode == 0


def test_status_of_a_free_lock(uri: str, name: str) -> None:
    """`lockrun status NAME` of a free lock says so; without NAME it lists nothing.

    In a namespace of its own: on the session's servers, other tests leave windows
    (--hold-at-least) of up to a year behind in the default one.
    """
    result = lockrun("status", "--uri", uri, name)
    assert result.returncode == 0
    assert f"{name}  -     free" in result.stdout
    empty = lockrun("status", "--uri", uri, "--namespace", name)
    assert empty.stdout.startswith(f"no locks held or awaited in namespace {name}")


def test_status_usage_errors() -> None:
    """`lockrun status` with a bad URI or name exits like the run command."""
    assert lockrun("status", "--uri", "nope://").returncode == ExitCode.CONFIG
    assert lockrun("status", "x" * 300).returncode == ExitCode.USAGE
    assert lockrun("status", "--frob").returncode == ExitCode.USAGE
    nameless = lockrun("status", "--check")
    assert nameless.returncode == ExitCode.USAGE
    assert "--check needs a NAME" in one_line(nameless.stderr)
    check = ("status", "--check", "--uri")
    assert lockrun(*check, "nope://", "x").returncode == ExitCode.CONFIG
    unreachable = lockrun(*check, "redis://127.0.0.1:1/0", "x")
    assert unreachable.returncode == ExitCode.UNAVAILABLE
    assert unreachable.stdout == ""
    one_line(unreachable.stderr)


def test_status_check_exits_75_while_anyone_holds_the_name(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """--check: 0 when free; 75 for readers and for a --hold-at-least window; -q prints nothing.

    Neither -q nor --check comes from LOCKRUN_QUIET or LOCKRUN_CHECK: a run's -q in the
    environment must not silence a status, and a status must not start failing.
    """
    check = ("status", "--uri", file_uri, "--check")
    quiet_env = os.environ | {"LOCKRUN_QUIET": "1", "LOCKRUN_CHECK": "1"}
    free = lockrun(*check, "-q", name)
    assert (free.returncode, free.stdout, free.stderr) == (0, "", "")
    reader = held("--uri", file_uri, "-n", name, "--shared")
    shared = lockrun(*check, "--json", name)
    assert shared.returncode == ExitCode.BUSY
    [state] = json.loads(shared.stdout)
    assert [holder["shared"] for holder in state["holders"]] == [True]
    assert f"{name} is held by " in one_line(shared.stderr)
    quiet = lockrun(*check, "--quiet", name)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (ExitCode.BUSY, "", "")
    plain = lockrun("status", "--uri", file_uri, name, env=quiet_env)
    assert (plain.returncode, plain.stderr) == (0, "")
    assert "sharing" in plain.stdout
    assert reader.finish() == 0
    window = lockrun("--uri", file_uri, "-n", name, "--hold-at-least", "1h", "--", "true")
    assert window.returncode == 0, window.stderr
    kept = lockrun(*check, name)
    assert kept.returncode == ExitCode.BUSY
    assert "held until" in kept.stdout
    assert "(--hold-at-least)" in one_line(kept.stderr)


def test_a_command_called_status_runs_after_the_separator(file_uri: str, tmp_path: Path) -> None:
    """`lockrun -- status` runs a command named status, not the subcommand."""
    script = tmp_path / "status"
    script.write_text("#!/bin/sh\necho ran-status\n")
    script.chmod(0o755)
    result = lockrun(
        "--uri",
        file_uri,
        "--",
        "status",
        env=os.environ | {"PATH": f"{tmp_path}:{os.environ['PATH']}"},
    )
    assert result.stdout == "ran-status\n"


# -- the file backend's own promises ----------------------------------------------------


def test_flock1_and_lockrun_exclude_each_other(file_uri: str, name: str, tmp_path: Path) -> None:
    """With one slot, lockrun and flock(1) on NAME.lock exclude each other."""
    lock_file = tmp_path / "locks" / f"{name}.lock"
    assert lockrun("--uri", file_uri, "-n", name, "--", "true").returncode == 0
    ready = tmp_path / "ready"
    flock = subprocess.Popen(
        ["flock", str(lock_file), "sh", "-c", f"touch {ready}; exec sleep 30"],
        start_new_session=True,
    )
    try:
        wait_for(ready.exists, what="flock(1)")
        assert lockrun("--uri", file_uri, "-n", name, "--", "true").returncode == 75
    finally:
        os.killpg(flock.pid, signal.SIGKILL)  # flock(1) and the sleep holding its fd
        flock.wait()
    wait_for(lambda: lockrun("--uri", file_uri, "-n", name, "--", "true").returncode == 0)
    # The command inherits the locked fd, as under flock(1); with --close it does not.
    fds = "for fd in /proc/self/fd/*; do readlink $fd; done; true"
    inherited = lockrun("--uri", file_uri, "-n", name, "--", "sh", "-c", fds)
    assert str(lock_file) in inherited.stdout.splitlines()
    closed = lockrun("--uri", file_uri, "-n", name, "--close", "--", "sh", "-c", fds)
    assert closed.returncode == 0
    assert str(lock_file) not in closed.stdout.splitlines()


def test_lock_files_are_never_deleted(file_uri: str, name: str, tmp_path: Path) -> None:
    """After runs, the lock, slot, gate and fence files stay (unlink races split waiters)."""
    assert lockrun("--uri", file_uri, "-n", name, "-s", "2", "--", "true").returncode == 0
    left = sorted(path.name for path in (tmp_path / "locks").iterdir())
    assert left == [f"{name}.fence", f"{name}.gate", f"{name}.lock", f"{name}~1.lock"]
    # Only the fence counter stays: the release blanked the holder record out.
    assert re.fullmatch(rb"\d+\n *", (tmp_path / "locks" / f"{name}.lock").read_bytes())


@needs_root
def test_default_directory_must_belong_to_us(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default directory is created 0700 and refused if another user owns it or a link."""
    home = tmp_path / "lockrun-home"
    monkeypatch.setattr(file_backend, "default_directory", lambda: Default(str(home), "/"))
    take_and_give_back(file_backend.connect(parse_uri("file:")))
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    home.chmod(0o755)
    take_and_give_back(file_backend.connect(parse_uri("file:")))
    assert stat.S_IMODE(home.stat().st_mode) == 0o700  # we tighten what we own
    os.chown(home, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to user nobody, not to us"):
        take_and_give_back(file_backend.connect(parse_uri("file:")))
    shutil.rmtree(home)
    home.symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="is a symlink"):
        take_and_give_back(file_backend.connect(parse_uri("file:")))


def take_and_give_back(backend: file_backend.FileBackend) -> None:
    """Take a lock of *backend* and release it: the lock directory is opened on first use."""
    try:
        lease = backend.acquire(Request("default", "probe", 1, 30.0, Holder.me(["true"])), None)
        assert lease is not None  # no deadline: it waited until it got the lock
        lease.release()
    finally:
        backend.close()


@needs_root
def test_lock_directory_that_is_not_writable_is_refused() -> None:
    """A lock directory we may not write to is a configuration error (78)."""
    shared = tempfile.mkdtemp(prefix="lockrun-readonly-", dir="/tmp")  # root's, 0700
    os.chmod(shared, 0o755)  # noqa: S103 - others may look, not write: the case under test
    os.seteuid(65534)
    try:
        with pytest.raises(ConfigError, match=f"lock directory {shared} is not writable"):
            take_and_give_back(file_backend.connect(parse_uri(f"file://{shared}")))
    finally:
        os.seteuid(0)
        os.rmdir(shared)


def test_signals_ignored_by_the_caller_stay_ignored(file_uri: str, name: str) -> None:
    """Under nohup or `trap '' HUP INT`, the command inherits the ignored HUP and INT."""
    lockrun_ = f"{sys.executable} -m lockrun --uri {file_uri} -n {name}"
    run = f"exec {lockrun_} -- grep SigIgn /proc/self/status"
    result = subprocess.run(
        ["sh", "-c", f"trap '' HUP INT; {run}"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    ignored = int(result.stdout.split()[1], 16)
    assert ignored & (1 << (signal.SIGHUP - 1))
    assert ignored & (1 << (signal.SIGINT - 1))
    assert not ignored & (1 << (signal.SIGTERM - 1))


LATE_TERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
open(sys.argv[1], "w").close()
time.sleep(30)
"""


def test_a_late_term_does_not_replace_the_commands_status(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """A second TERM arriving as the command ends leaves lockrun with the command's status."""
    script = tmp_path / "late.py"
    script.write_text(LATE_TERM)
    for attempt in range(10):
        ready = tmp_path / f"ready-{attempt}"
        process = start(
            "--uri", file_uri, "-n", name, "--", sys.executable, str(script), str(ready)
        )
        wait_for(ready.exists, what="the command")
        for _ in range(2):  # the second one lands while lockrun is finishing
            process.send_signal(signal.SIGTERM)
            time.sleep(0.0005 * (1 + attempt % 5))
        _, stderr = process.communicate(timeout=30)
        assert (process.returncode, stderr) == (7, ""), attempt


# -- -v on a terminal: one live line ----------------------------------------------------


def live_waiter(file_uri: str, name: str, columns: int = 200) -> Terminal:
    """Start a verbose waiter for *name* with a terminal as stdin, stdout and stderr."""
    argv = [*LOCKRUN, "--uri", file_uri, "-n", name, "-v", "-w", "forever"]
    return Terminal([*argv, "--", "echo", "ran"], env=os.environ, columns=columns)


def test_verbose_on_a_terminal_redraws_one_line_then_erases_it(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """On a terminal, -v redraws one waiting line each second and erases it once acquired."""
    holder = held("--uri", file_uri, "-n", name)
    host = os.uname().nodename
    with live_waiter(file_uri, name) as term:
        term.read_until(b"\r\x1b[K", count=3)  # drawn, then redrawn twice
        holder.finish()
        screen = term.read_to_end().decode()
    assert term.process.returncode == 0
    drawn, _, after = screen.rpartition("\r\x1b[K")
    frames = drawn.split("\r\x1b[K")[1:]
    since = r"since \d\d:\d\d:\d\d"
    seconds = []
    for frame in frames:
        shown = re.fullmatch(
            rf"lockrun: waiting for {name} — held by {host}:{holder.process.pid} {since}"
            rf" — next in line — (\d+)s",
            frame,
        )
        assert shown is not None, frames
        seconds.append(int(shown[1]))
    assert seconds[0] == 0
    assert seconds == sorted(seconds)
    assert seconds[-1] >= 1
    assert after.startswith(f"lockrun: acquired {name} slot 0 of 1 after ")  # on a clean line
    assert "\r\nran\r\n" in after


def test_the_live_line_fits_the_terminal(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """A live line longer than the terminal is cut to fit, so a redraw cannot wrap."""
    holder = held("--uri", file_uri, "-n", name)
    with live_waiter(file_uri, name, columns=40) as term:
        term.read_until(b"\r\x1b[K", count=2)  # the first line and a redraw
        holder.finish()
        screen = term.read_to_end().decode()
    frames = screen.rpartition("\r\x1b[K")[0].split("\r\x1b[K")[1:]
    assert frames
    assert all(len(frame) == 39 for frame in frames), frames
    assert frames[0] == f"lockrun: waiting for {name} — held by "[:39]


def test_a_line_said_while_live_goes_above_it(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """INT while the live line shows: the line is erased and the one-line error stands alone."""
    held("--uri", file_uri, "-n", name)
    with live_waiter(file_uri, name) as term:
        term.read_until(b"next in line")
        term.process.send_signal(signal.SIGINT)
        screen = term.read_to_end().decode()
    assert term.process.returncode == 130
    assert screen.endswith(f"\r\x1b[Klockrun: SIGINT while waiting for {name}; nothing is held\r\n")


def test_status_json_can_come_from_the_environment(file_uri: str) -> None:
    """LOCKRUN_JSON=1 makes `lockrun status` print JSON, as every option has its variable."""
    result = lockrun("status", "--uri", file_uri, env={**os.environ, "LOCKRUN_JSON": "1"})
    assert (result.returncode, result.stdout) == (0, "[]\n")


def test_the_wait_report_thread_takes_no_signal(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """-v's report thread blocks every signal: a SIGCHLD it took would be lost to the supervisor."""
    held("--uri", file_uri, "-n", name)
    waiter = start("--uri", file_uri, "-n", name, "-v", "-w", "forever", "--", "true")
    try:
        assert waiter.stderr is not None
        assert waiter.stderr.readline().startswith(f"lockrun: waiting for {name} ")
        threads: list[str] = []

        def started() -> bool:
            tasks = os.listdir(f"/proc/{waiter.pid}/task")
            threads[:] = [task for task in tasks if int(task) != waiter.pid]
            return bool(threads)

        wait_for(started, what="the report thread")  # it starts after the first line
        assert len(threads) == 1, threads  # the report's
        status = Path(f"/proc/{waiter.pid}/task/{threads[0]}/status").read_text()
        found = re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.MULTILINE)
        assert found is not None
        blocked = int(found[1], 16)
        for signo in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            assert blocked & (1 << (signo - 1)), f"{signo.name} is not blocked"
    finally:
        waiter.kill()
        waiter.communicate()


def test_a_line_said_while_the_live_line_shows_goes_above_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A line said during the wait erases the live line, prints, then draws it again."""
    output.LIVE.show("waiting for x — 3s")
    output.say("queued again")
    output.LIVE.show("")
    assert capsys.readouterr().err == (
        "\r\x1b[Klockrun: waiting for x — 3s"
        "\r\x1b[Klockrun: queued again\nlockrun: waiting for x — 3s"
        "\r\x1b[K"
    )
    output.say("after")
    assert capsys.readouterr().err == "lockrun: after\n"


# -- a subcommand word after options (#29 7b) -----------------------------------------------
# `lockrun -u URI status NAME` ran a program called status (127); with --no-keeper the
# natural `lockrun -u URI release TOKEN` left the lock held. docs/semantics.md "Options".

# A keeper's token of the right shape that no keeper holds: release and renew answer 76.
NO_KEEPER_HOLDS = "lr1.0.0123456789abcdef.XPmN-ZGWL8hxiaXKJHof1Yr1"
ALL_COMMANDS = (cli.run_command, *(command for command, _ in cli.SUBCOMMANDS.values()))


def _value_options() -> list[str]:
    """Every option of any command that takes a value, by its long spelling."""
    spelled = {
        max(param.opts, key=len)
        for command in ALL_COMMANDS
        for param in command.params
        if isinstance(param, click.Option) and not param.is_flag and not param.count
    }
    return sorted(spelled)


def _value_of(option: str, file_uri: str, name: str, tmp_path: Path) -> str:
    """Return a valid value of *option*, harmless for every command that takes it."""
    uri_file = tmp_path / "uri"
    uri_file.write_text(file_uri)
    uri_file.chmod(0o600)
    values = {
        "--name": name,
        "--uri": file_uri,
        "--uri-file": str(uri_file),
        "--slots": "1",
        "--wait": "0",
        "--ttl": "30",
        "--max-time": "1h",
        "--kill-after": "1s",
        "--lost-kill-after": "1s",
        "--conflict-exit-code": "75",
        "--hold-at-least": "1s",
        "--namespace": "default",
        "--on-start": "true",
        "--on-busy": "true",
        "--on-exit": "true",
        "--hook-max-time": "5s",
        "--metrics-file": str(tmp_path / "lockrun.prom"),
        "--owner": str(os.getpid()),
        "--env-file": str(tmp_path / "env"),
        "--var": "SECOND_TOKEN",
    }
    return values[option]  # a KeyError: a new option needs a value here


@pytest.mark.parametrize("option", _value_options())
@pytest.mark.parametrize("subcommand", list(cli.SUBCOMMANDS))
def test_options_before_a_subcommand_are_its_own_or_refused(
    option: str, subcommand: str, file_uri: str, name: str, tmp_path: Path
) -> None:
    """OPTION VALUE SUBCOMMAND is SUBCOMMAND OPTION VALUE, or a usage error naming the way out.

    Asked of `cli.dispatch`, which is all that `main` does before the command runs: the same
    command with the same arguments means the same run. test_a_subcommand_after_options_runs_
    as_its_own_command runs both orders as processes, one option a subcommand.
    """
    value = _value_of(option, file_uri, name, tmp_path)
    rest = {"status": [name], "acquire": [name], "release": [NO_KEEPER_HOLDS]}
    rest["renew"] = rest["release"]
    after = cli.dispatch([subcommand, option, value, *rest[subcommand]])
    before = [option, value, subcommand, *rest[subcommand]]
    if option not in _grammar_of(after[0]):  # not its own: refused, naming the way out
        with pytest.raises(click.UsageError, match=f"-- {subcommand}"):
            cli.dispatch(before)
        return
    assert cli.dispatch(before) == after


def _grammar_of(command: click.Command) -> set[str]:
    return {spelling for param in command.params for spelling in getattr(param, "opts", [])}


@pytest.mark.parametrize("subcommand", list(cli.SUBCOMMANDS))
def test_a_subcommand_after_options_runs_as_its_own_command(
    subcommand: str, file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """`lockrun -u URI SUBCOMMAND …` and `lockrun SUBCOMMAND -u URI …` end alike, as processes."""
    rest = {"status": [name], "acquire": [name], "release": [NO_KEEPER_HOLDS]}
    rest["renew"] = rest["release"]
    if subcommand == "acquire":  # busy: it must not leave a keeper behind
        held("--uri", file_uri, "-n", name)
    before = lockrun("--uri", file_uri, subcommand, *rest[subcommand])
    after = lockrun(subcommand, "--uri", file_uri, *rest[subcommand])
    for result in (before, after):
        assert result.returncode not in {ExitCode.SOFTWARE, ExitCode.USAGE, 126, 127}, result.stderr
        assert "Traceback" not in result.stderr
    assert (before.returncode, before.stdout, before.stderr) == (
        after.returncode,
        after.stdout,
        after.stderr,
    )


def test_a_subcommand_after_options_it_does_not_take_is_a_usage_error(file_uri: str) -> None:
    """`lockrun -n job status` exits 64 with one line naming `--`; `-- status` runs the program."""
    refused = lockrun("--uri", file_uri, "-n", "job", "-q", "status")
    assert refused.returncode == ExitCode.USAGE
    line = one_line(refused.stderr)
    assert "-n" in line
    assert "lockrun status" in line
    assert "-- status" in line
    ran = lockrun("--uri", file_uri, "-n", "job", "--", "status", "--version")
    assert ran.returncode == 127  # the program: none of that name here
    assert "status: command not found" in one_line(ran.stderr)


def test_the_status_subcommand_takes_the_options_before_it(
    file_uri: str, name: str, held: Callable[..., Held]
) -> None:
    """`lockrun -u URI --namespace NS status NAME` shows NAME's holder, as `status -u …` does."""
    holder = held("--uri", file_uri, "-n", name)
    result = lockrun("-u", file_uri, "--namespace=default", "-q", "status", "--check", name)
    assert result.returncode == ExitCode.BUSY
    assert result.stdout == ""
    shown = lockrun("-u", file_uri, "status", "--json", name)
    assert shown.returncode == 0
    assert json.loads(shown.stdout)[0]["holders"][0]["pid"] == holder.process.pid


def test_options_before_release_end_a_no_keeper_lease(
    redis_uri: str, name: str, tmp_path: Path
) -> None:
    """`lockrun -u URI acquire --no-keeper`, `--uri-file F renew` and `-u URI release` work."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCKRUN_")}
    taken = lockrun("-u", redis_uri, "--ttl", "30", "acquire", "--no-keeper", name, env=env)
    assert taken.returncode == 0, taken.stderr
    token = taken.stdout.strip()
    uri_file = tmp_path / "uri"
    uri_file.write_text(redis_uri)
    uri_file.chmod(0o600)
    renewed = lockrun("--uri-file", str(uri_file), "renew", token, env=env)
    assert renewed.returncode == 0, renewed.stderr
    with pytest.raises(LockBusy):  # the lease is on the server
        Lock(name, uri=redis_uri).acquire()
    released = lockrun("-u", redis_uri, "-v", "release", token, env=env)
    assert released.returncode == 0, released.stderr
    assert one_line(released.stderr).startswith(f"lockrun: released {name}")
    with Lock(name, uri=redis_uri) as lease:  # the oracle: free on the server
        assert lease.slot == 0


# What a file: run has no use for (issue #32): click's did-you-mean for a short option
# (difflib), gettext's translation lookup (locale), the holder record's JSON (json), a
# metrics file's hash (hashlib). The take-over bell's ctypes: test_supervise, which allows
# for a loaded machine.
UNNEEDED = ("difflib", "locale", "json", "hashlib")


@pytest.mark.parametrize("options", [(), ("-q", "-v"), ("--name=x",)])
def test_a_short_file_run_imports_nothing_it_does_not_use(
    file_uri: str, name: str, options: tuple[str, ...]
) -> None:
    """`lockrun -u URI -n NAME -- true` imports none of `UNNEEDED` (python -X importtime says)."""
    argv = [*LOCKRUN, "--uri", file_uri, "-n", name, *options, "--", "true"]
    run = subprocess.run(
        [sys.executable, "-X", "importtime", *argv[1:]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    imported = {line.rpartition("|")[2].strip() for line in run.stderr.splitlines()}
    assert "lockrun.backends.file.backend" in imported
    assert sorted(imported & set(UNNEEDED)) == []
