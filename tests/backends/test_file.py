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
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lockrun import LeaseLost, Lock
from lockrun.backends import Holder, Request, inotify, open_backend, parse_uri
from lockrun.backends.file import FileBackend, FileLease, records
from lockrun.timing import now
from tests.support.cli import (
    RING_TTL,
    Held,
    finish,
    lock_state,
    lockrun,
    queue_length,
    start,
    take_over_ring,
    wait_for,
    waiter_pids,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from subprocess import Popen


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
    script = f"touch {flocked}; while [ ! -e {go} ]; do sleep 0.05; done"
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
    assert re.fullmatch(rb"\d+\n *", (tmp_path / "locks" / f"{name}.lock").read_bytes())


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
    """NAME.lock: the counter, then the holder's JSON; the counter stays, and is obeyed.

    A release blanks the record out, and a shorter record blanks the rest of a longer one:
    the file keeps its size (a truncate each cycle cost the kernel several µs, #32).
    """
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
        assert record.rstrip(b" ") == (json.dumps(data) + "\n").encode()  # as json writes it
        assert (
            data
            == {"name": name, "namespace": "default", "slots": 1}
            | Holder.me(["test"])._replace(since=data["since"], slot=0).to_dict()
        )
        size = lock_file.stat().st_size
        lease.release()
        assert lock_file.read_bytes() == f"{fence}\n".encode().ljust(size)


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


# -- the modes (docs/design.md A1) ------------------------------------------------------


def flocked(tmp_path: Path, lock_file: Path, *options: str) -> tuple[subprocess.Popen[str], Path]:
    """Start ``flock OPTIONS LOCK_FILE`` holding until the returned path exists; wait for it."""
    tag = uuid.uuid4().hex[:8]
    ready, go = tmp_path / f"flock-ready-{tag}", tmp_path / f"flock-go-{tag}"
    script = f"touch {ready}; while [ ! -e {go} ]; do sleep 0.05; done"
    lock_file.parent.mkdir(exist_ok=True)
    process = subprocess.Popen(["flock", *options, str(lock_file), "sh", "-c", script], text=True)
    wait_for(lambda: ready.exists() or process.poll() is not None, what="flock(1)")
    assert ready.exists(), f"flock(1) {options} did not get the lock"
    return process, go


def test_shared_and_exclusive_exclude_flock1_users_both_ways(
    tmp_path: Path, name: str, held: Callable[..., Held]
) -> None:
    """`flock -s` shares with --shared and excludes a writer; `flock -x` excludes a reader."""
    uri, lock_file = f"file://{tmp_path}/locks", tmp_path / "locks" / f"{name}.lock"
    reader, go = flocked(tmp_path, lock_file, "-s")
    assert lockrun("--uri", uri, "-n", name, "--shared", "--", "true").returncode == 0
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 75
    go.touch()
    assert reader.wait(10) == 0
    writer, go = flocked(tmp_path, lock_file, "-x")
    assert lockrun("--uri", uri, "-n", name, "--shared", "--", "true").returncode == 75
    go.touch()
    assert writer.wait(10) == 0
    ours = held("--uri", uri, "-n", name, "--shared")
    assert (
        subprocess.run(["flock", "-s", "-n", str(lock_file), "true"], check=False).returncode == 0
    )
    assert (
        subprocess.run(["flock", "-x", "-n", str(lock_file), "true"], check=False).returncode == 1
    )
    assert ours.finish() == 0
    assert (
        subprocess.run(["flock", "-x", "-n", str(lock_file), "true"], check=False).returncode == 0
    )


def test_shared_holders_leave_the_lock_file_alone_and_have_no_fence(
    kept: FileBackend, tmp_path: Path, name: str
) -> None:
    """A reader writes no record and cuts nothing off; status names each reader from the kernel."""
    take(kept, name).release()
    lock_file = tmp_path / "locks" / f"{name}.lock"
    before = lock_file.read_bytes()
    request = Request("default", name, 1, 30.0, Holder.me(["test"]), shared=True)
    readers = [kept.acquire(request, 0) for _ in range(2)]
    assert all(reader is not None and reader.fence is None for reader in readers)
    assert lock_file.read_bytes() == before
    (state,) = kept.status("default", name)
    assert [(holder.pid, holder.shared, holder.slot) for holder in state.holders] == [
        (os.getpid(), True, 0),
        (os.getpid(), True, 0),
    ]
    for reader in readers:
        assert reader is not None
        reader.release()
    assert lock_file.read_bytes() == before
    assert kept.status("default", name)[0].holders == ()


def test_shared_waiters_show_as_shared_in_the_gate_and_at_the_head(
    tmp_path: Path, name: str, held: Callable[..., Held], spawn: Callable[..., Popen[str]]
) -> None:
    """Behind a writer, a reader at the head (LOCK_SH) and one in the gate (its mark) are shared."""
    uri = f"file://{tmp_path}/locks"
    writer = held("--uri", uri, "-n", name)
    first = spawn("--uri", uri, "-n", name, "--shared", "-w", "30", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 1, what="the first reader")
    second = spawn("--uri", uri, "-n", name, "--shared", "-w", "30", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 2, what="the second reader")
    third = spawn("--uri", uri, "-n", name, "-w", "30", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 3, what="the writer")
    waiters = lock_state(uri, name)["waiters"]
    assert [(waiter["pid"], waiter["shared"]) for waiter in waiters] == [
        (first.pid, True),
        (second.pid, True),
        (third.pid, False),
    ]
    assert writer.finish() == 0
    assert [finish(process) for process in (first, second, third)] == [0, 0, 0]


def test_a_window_is_the_runs_record_with_until_left_in_the_lock_file(
    kept: FileBackend, tmp_path: Path, name: str
) -> None:
    """release(hold) leaves counter and record, with until; the next grant overwrites both."""
    lock_file = tmp_path / "locks" / f"{name}.lock"
    lease = take(kept, name)
    # The window must outlast the reads below (a few file operations, no start-up) on a
    # loaded machine: 3 s, not the 0.4 s that once sufficed.
    hold = 3.0
    began = time.time()
    lease.release(hold=hold)
    counter, record = lock_file.read_bytes().split(b"\n", 1)
    assert counter == str(lease.fence).encode()
    data = json.loads(record)
    assert data["pid"] == os.getpid()
    assert began + hold - 0.1 < data["until"] < time.time() + hold
    assert kept.acquire(Request("default", name, 1, 30.0, Holder.me(["x"])), 0) is None
    (state,) = kept.status("default", name)
    assert [holder.until for holder in state.holders] == [data["until"]]
    waited = time.monotonic()
    after = kept.acquire(Request("default", name, 1, 30.0, Holder.me(["x"])), now() + 60)
    assert after is not None
    assert time.time() >= data["until"]
    assert time.monotonic() - waited < 60  # granted as the window ended, not at the deadline
    assert json.loads(lock_file.read_bytes().split(b"\n", 1)[1])["until"] is None
    after.release()
    assert lock_file.read_bytes().rstrip(b" ") == f"{after.fence}\n".encode()


def test_a_waiter_waits_out_a_window_holding_the_lock_first_in_line(
    tmp_path: Path, name: str, spawn: Callable[..., Popen[str]]
) -> None:
    """The waiter that got the flock sleeps out the window: status shows the run, then it."""
    uri = f"file://{tmp_path}/locks"
    assert lockrun("--uri", uri, "-n", name, "--hold-at-least", "3", "--", "true").returncode == 0
    waiter = spawn("--uri", uri, "-n", name, "-w", "30", "--", "true")
    wait_for(lambda: waiter_pids(uri, name) == [waiter.pid], what="the waiter")
    (holder,) = lock_state(uri, name)["holders"]
    assert holder["until"] is not None
    assert holder["pid"] != waiter.pid
    assert finish(waiter) == 0
    assert lock_state(uri, name)["holders"] == []


@pytest.mark.parametrize("options", [(), ("--shared",)])
def test_a_holder_hears_a_taker_at_once_through_its_bell(
    tmp_path: Path, name: str, options: tuple[str, ...]
) -> None:
    """The taker's request rings the holder's inotify watch: TERM long before a renewal."""
    assert take_over_ring(f"file://{tmp_path}/locks", tmp_path, name, *options) < RING_TTL / 3


def request_locks(path: Path) -> list[str]:
    """Return the OFD write locks /proc/locks lists on the file *path*: take-over requests."""
    inode = f":{os.stat(path).st_ino} "
    return [
        line
        for line in Path("/proc/locks").read_text().splitlines()
        if inode in line and "OFDLCK" in line and "WRITE" in line
    ]


def test_a_takers_request_is_a_write_lock_on_the_lock_file_while_it_waits(
    tmp_path: Path, name: str, spawn: Callable[..., Popen[str]]
) -> None:
    """One byte far past the end of NAME.lock, locked while the taker waits, free after."""
    uri = f"file://{tmp_path}/locks"
    lock_file = tmp_path / "locks" / f"{name}.lock"
    flock_holder, go = flocked(tmp_path, lock_file, "-x")
    taker = spawn("--uri", uri, "-n", name, "--take-over", "-w", "1.5", "--", "true")
    wait_for(lambda: request_locks(lock_file), what="the request")
    (request,) = request_locks(lock_file)
    start, end = map(int, request.split()[-2:])
    assert start == end >= 2**62  # no flock(1) user, nor any record, ever meets it
    assert finish(taker) == 75  # flock(1) hears nobody: the taker gives up
    assert request_locks(lock_file) == []
    assert not (tmp_path / "locks" / f"{name}.stop").exists()
    go.touch()
    assert flock_holder.wait(10) == 0


def test_a_deleted_lock_file_is_heard_at_once_by_a_python_holder(tmp_path: Path, name: str) -> None:
    """The bell also rings for an unlink: check() raises LeaseLost, no ttl/3 to wait.

    Leaving the block raises it again, as for any lease found lost (docs/api.md).
    """
    lock = Lock(name, uri=f"file://{tmp_path}/locks")
    lease = lock.acquire()
    lease.check()
    (tmp_path / "locks" / f"{name}.lock").unlink()
    time.sleep(0.05)  # no renewal ran meanwhile: a local lease has none
    with pytest.raises(LeaseLost, match="deleted or replaced"):
        lease.check()
    with pytest.raises(LeaseLost, match="deleted or replaced"):
        lock.release()


def test_without_inotify_a_lease_has_no_bell(
    kept: FileBackend, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No inotify (not Linux, or no instance left): no bell, refreshes alone hear a taker."""
    monkeypatch.setattr(inotify, "_CALLS", [lambda *_: -1])
    lease = take(kept, name)
    assert lease.bells == ()
    lease.release()


def test_records_and_requests_count_from_us_root_and_our_groups_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whose lock file is believed: ours, root's, one of our groups'; never one open to all."""

    def info(uid: int, gid: int, mode: int) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    monkeypatch.setattr(os, "getgroups", lambda: [50])
    monkeypatch.setattr(records, "_member", lambda uid, gid: (uid, gid) == (54321, 50))
    assert records.stranger(info(1000, 1000, 0o100644)) is None
    assert records.stranger(info(0, 0, 0o100644)) is None
    assert records.stranger(info(54321, 50, 0o100664)) is None  # a fellow member's
    # Our group, but its owner no member: a set-group-ID directory gave it the group.
    assert records.stranger(info(54322, 50, 0o100644)) == "uid 54322"
    assert records.stranger(info(54321, 54321, 0o100644)) == "uid 54321"
    assert records.stranger(info(1000, 1000, 0o100666)) == "every user"
