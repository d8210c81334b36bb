"""The file: backend: odd lock files, flock(1) slots, the fence counter, a kept backend."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import LeaseLost
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.file import FileBackend, FileLease
from tests.support.cli import Held, finish, lockrun, queue_length, start, wait_for

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
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
    assert re.fullmatch(rb"\d+\n", (tmp_path / "locks" / f"{name}.lock").read_bytes())


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


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[FileBackend]:
    """Return one file: backend on tmp_path/locks, kept across acquisitions as Lock keeps it."""
    backend = open_backend(parse_uri(f"file://{tmp_path}/locks"))
    assert isinstance(backend, FileBackend)
    yield backend
    backend.close()


def take(backend: FileBackend, name: str, slots: int = 1) -> FileLease:
    """Acquire one slot of *name* at once; fail the test if it is busy."""
    lease = backend.acquire(Request("default", name, slots, 30.0, Holder.me(["test"])), 0)
    assert lease is not None
    return lease


def is_locked(path: Path) -> bool:
    """Whether someone holds a flock on the file *path* names now."""
    with path.open("rb") as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_a_kept_backend_locks_in_the_directory_its_path_names_now(
    kept: FileBackend, tmp_path: Path, name: str, how: str
) -> None:
    """A lock directory removed (a tmpfs cleaned up) or replaced: the next lock is the path's."""
    take(kept, name).release()  # the backend now holds the directory open
    locks = tmp_path / "locks"
    if how == "removed":
        shutil.rmtree(locks)
    else:
        locks.rename(tmp_path / "old")
        locks.mkdir()
    lease = take(kept, name)
    try:
        assert is_locked(locks / f"{name}.lock")  # the file every other process opens
    finally:
        lease.release()
    assert not is_locked(locks / f"{name}.lock")


def test_a_lock_directory_replaced_under_a_holder_loses_the_lease(
    kept: FileBackend, tmp_path: Path, name: str
) -> None:
    """Newcomers would lock the new directory's file: the holder's refresh says it is lost."""
    lease = take(kept, name)
    lease.refresh()
    (tmp_path / "locks").rename(tmp_path / "old")
    (tmp_path / "locks").mkdir()
    with pytest.raises(LeaseLost, match="was deleted or replaced"):
        lease.refresh()
    lease.release()


def test_the_fence_counter_is_the_lock_files_first_line_and_outlives_its_holder(
    kept: FileBackend, tmp_path: Path, name: str
) -> None:
    """NAME.lock: the counter, then the holder's JSON; the counter stays, and is obeyed."""
    lock_file = tmp_path / "locks" / f"{name}.lock"
    ahead = time.time_ns() // 1000 + 10**12  # a counter the clock does not reach
    lease = take(kept, name)
    lease.release()
    lock_file.write_text(f"{ahead}\n")
    for fence in (ahead + 1, ahead + 2):
        lease = take(kept, name)
        assert lease.fence == fence
        counter, record = lock_file.read_bytes().split(b"\n", 1)
        assert counter == str(fence).encode()
        data = json.loads(record)
        assert record == (json.dumps(data) + "\n").encode()  # one line, as json writes it
        assert (
            data
            == {"name": name, "namespace": "default", "slots": 1}
            | Holder.me(["test"])._replace(since=data["since"], slot=0).to_dict()
        )
        lease.release()
        assert lock_file.read_bytes() == f"{fence}\n".encode()


def test_fences_grow_across_an_older_counter_a_semaphore_and_a_lock(
    kept: FileBackend, tmp_path: Path, name: str
) -> None:
    """NAME.fence (an older lockrun's, or a semaphore's) and NAME.lock's line: above both."""
    locks = tmp_path / "locks"
    locks.mkdir()
    ahead = time.time_ns() // 1000 + 10**12
    (locks / f"{name}.fence").write_text(f"{ahead}\n")  # NAME.lock has no counter line
    lease = take(kept, name)
    assert lease.fence == ahead + 1
    lease.release()
    first = take(kept, name, slots=2)  # slot 0: above NAME.lock's line
    second = take(kept, name, slots=2)  # slot 1: NAME.lock's line is not written
    assert (first.slot, first.fence, second.slot, second.fence) == (0, ahead + 2, 1, ahead + 3)
    first.release()
    second.release()
    lease = take(kept, name)  # slot files beside NAME.lock: NAME.fence is read as well
    assert lease.fence == ahead + 4
    lease.release()
