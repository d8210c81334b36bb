"""The file: backend: lock files that are directories or hold foreign text, flock(1) slots."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import TYPE_CHECKING

import pytest

from tests.support.cli import Held, finish, lockrun, queue_length, start, wait_for

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


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
        *("--uri", uri, "-n", name, "-s", "2", "-w", "forever", "--", "sh", "-c"),
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
