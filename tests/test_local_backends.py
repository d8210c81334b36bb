"""Behaviour specific to the local backends: edge names, crashes, threads, flock(1) slots."""

from __future__ import annotations

import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import ConfigError, Lock, LockBusy
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends import abstract as abstract_backend
from lockrun.timing import now
from lockrun.uri import SCHEMES, Scheme
from tests.support.cli import Held, finish, lockrun, queue_length, start, wait_for

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


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


def test_a_lock_path_that_is_a_directory_exits_78(tmp_path: Path, name: str) -> None:
    """A directory where the lock file should be is a configuration error."""
    (tmp_path / "locks" / f"{name}.lock").mkdir(parents=True)
    result = lockrun("--uri", f"file://{tmp_path}/locks", "-n", name, "--", "true")
    assert result.returncode == 78
    assert "Is a directory" in result.stderr


def test_a_slot_held_by_flock1_is_respected_and_its_release_noticed(
    tmp_path: Path, name: str, held: Callable[..., Held]
) -> None:
    """flock(1) on NAME.lock takes slot 0 of a semaphore; its release lets the head in."""
    uri = f"file://{tmp_path}/locks"
    first = held("--uri", uri, "-n", name, "-s", "2")  # slot 0
    flocked, go = tmp_path / "flocked", tmp_path / "go"
    script = f"touch {flocked}; while [ ! -e {go} ]; do sleep 0.01; done"
    flock = subprocess.Popen(
        ["flock", str(tmp_path / "locks" / f"{name}~1.lock"), "sh", "-c", script]
    )
    wait_for(flocked.exists, what="flock(1)")
    assert lockrun("--uri", uri, "-n", name, "-s", "2", "--", "true").returncode == 75
    waiter = start(
        "--uri",
        uri,
        "-n",
        name,
        "-s",
        "2",
        "-w",
        "forever",
        "--",
        "sh",
        "-c",
        "echo $LOCKRUN_SLOT",
        stdout=subprocess.PIPE,
    )
    wait_for(lambda: queue_length(uri, name) == 1, what="the head")
    go.touch()  # the flock(1) holder has no wake-up socket: the head notices by looking
    out, _ = waiter.communicate(timeout=30)
    assert (waiter.returncode, out) == (0, "1\n")
    assert flock.wait(10) == 0
    first.finish()


def test_stale_record_of_a_dead_holder_is_no_mismatch(tmp_path: Path, name: str) -> None:
    """A record left by a killed holder with other --slots does not block a new user."""
    uri = f"file://{tmp_path}/locks"
    ready = tmp_path / "ready"
    script = f"echo $$ > {ready}.tmp; mv {ready}.tmp {ready}; exec sleep 30"
    process = start("--uri", uri, "-n", name, "-s", "2", "--", "sh", "-c", script)
    wait_for(ready.exists, what="the holder")
    process.kill()  # lockrun first, so it cannot clear its record
    os.kill(int(ready.read_text()), signal.SIGKILL)  # then the command, which kept the fd
    finish(process)
    assert b'"slots": 2' in (tmp_path / "locks" / f"{name}.lock").read_bytes()
    assert lockrun("--uri", uri, "-n", name, "-s", "1", "--", "true").returncode == 0
    assert (tmp_path / "locks" / f"{name}.lock").read_bytes() == b""


def test_abstract_name_bound_but_not_listening_is_waited_out(name: str) -> None:
    """A holder caught between bind and listen makes waiters look again, not fail."""
    backend = open_backend(parse_uri("abstract:edge"))
    request = Request("default", name, 1, 30.0, Holder.me(["test"]))
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(f"\0lockrun/edge/default/{name}/0")
    assert backend.acquire(request, now() + 0.2) is None
    squatter.close()
    lease = backend.acquire(request, now() + 5)
    assert lease is not None
    lease.release()


def test_abstract_is_refused_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    """abstract: names the platform and the alternative where it cannot work."""
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="needs Linux abstract UNIX sockets; this is darwin"):
        abstract_backend.connect(parse_uri("abstract:"))


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheme whose driver is not installed is a configuration error naming the extra."""
    monkeypatch.setitem(SCHEMES, "nosuch", Scheme("nosuch", "nosuch:", {}, extra="nosuch"))
    with pytest.raises(ConfigError, match=r"pip install 'lockrun-cli\[nosuch\]'"):
        open_backend(parse_uri("nosuch://x"))


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


@pytest.mark.parametrize("content", ["12345\n", "[1, 2]\n", '"text"\n', "{not json\n"])
def test_foreign_content_in_a_lock_file_is_ignored(tmp_path: Path, name: str, content: str) -> None:
    """A lock file holding a flock(1) user's pid or other non-record text still works."""
    uri = f"file://{tmp_path}/locks"
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / f"{name}.lock").write_text(content)
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0
    (tmp_path / "locks" / f"{name}.lock").write_text(content)
    status = lockrun("status", "--uri", uri, name)
    assert (status.returncode, status.stderr) == (0, "")
