"""The local backends' modes under forged records: windows, take-over requests, readers.

Another user writes what the modes read back: an ``until`` in a shared lock file, a
NAME.stop planted or flocked, abstract names squatted. Each may make a lock look busy (the
power of holding it), never crash lockrun, hold a lock for ever or stop a holder it may not
take (docs/security.md). Properties over random input close the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun.backends import Holder, Request
from lockrun.backends import abstract as abstract_backend
from lockrun.backends import file as file_backend
from lockrun.backends.file.records import window_end
from lockrun.bounds import MAX_WAIT
from lockrun.errors import TakenOver
from tests.support.cli import Held, lockrun, one_line, wait_for
from tests.support.strategies import holder_like, json_values
from tests.support.users import needs_root

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.users import Runner

PRECIOUS = "precious: root's file, not a lock\n"


@pytest.fixture
def locks(shared: Path) -> Path:
    """Return a lock directory every user may write to, sticky, as flock(1) users share."""
    path = shared / "locks"
    path.mkdir()
    path.chmod(0o1777)
    return path


def record(name: str, until: object) -> bytes:
    """Return a lock file: a counter line and a well-formed record of *name* ending *until*."""
    data = {"name": name, "namespace": "default", "slots": 1, "host": "h", "pid": 1}
    data |= {"user": "mallory", "argv": ["x"], "since": time.time(), "until": until}
    return b"1\n" + json.dumps(data).encode() + b"\n"


# -- file: forged windows ---------------------------------------------------------------


@pytest.mark.parametrize(
    "until",
    [
        pytest.param(lambda: time.time() + 10 * 366 * 86400, id="ten-years"),
        pytest.param(lambda: -5, id="negative"),
        pytest.param(lambda: "soon", id="text"),
        pytest.param(lambda: True, id="bool"),
        pytest.param(lambda: [time.time() + 60], id="list"),
        pytest.param(lambda: float("inf"), id="infinity"),
        pytest.param(lambda: time.time() - 5, id="over"),
    ],
)
def test_a_window_no_lockrun_could_have_left_is_none(
    locks: Path, name: str, until: Callable[[], object]
) -> None:
    """Root's own lock file ends a window in ten years, never, or at 'soon': no window at all.

    Root's, 0644: a file whose records count (another user's never do: test_users.py).
    """
    lock_file = locks / f"{name}.lock"
    lock_file.write_bytes(record(name, until()).replace(b"Infinity", b"1e400"))  # JSON's inf
    lock_file.chmod(0o644)
    result = lockrun("--uri", f"file://{locks}", "-n", name, "--", "true")
    assert (result.returncode, result.stderr) == (0, "")
    status = lockrun("status", "--uri", f"file://{locks}", "--json", name)
    assert (status.returncode, status.stderr) == (0, "")
    assert json.loads(status.stdout)[0]["holders"] == []


def test_a_window_a_lockrun_could_have_left_is_busy_and_shown(locks: Path, name: str) -> None:
    """An hour's window in root's own 0644 file: busy at once (75), as any holder makes it."""
    lock_file = locks / f"{name}.lock"
    lock_file.write_bytes(record(name, time.time() + 3600))
    lock_file.chmod(0o644)
    result = lockrun("--uri", f"file://{locks}", "-n", name, "-w", "1800", "--", "true")
    assert result.returncode == 75  # at once: the window outlasts the half hour's wait
    assert "--hold-at-least" in one_line(result.stderr)
    status = lockrun("status", "--uri", f"file://{locks}", "--json", name)
    (holder,) = json.loads(status.stdout)[0]["holders"]
    assert (holder["user"], holder["until"] > time.time()) == ("mallory", True)


# -- file: forged and planted take-over requests ------------------------------------------


def file_lease(locks: Path, name: str) -> file_backend.FileLease:
    """Take *name* in *locks* through the backend, as root; fail if busy."""
    backend = file_backend.FileBackend(str(locks), private=False, make_below="/")
    lease = backend.acquire(Request("default", name, 1, 30.0, Holder.me(["root"])), 0)
    assert lease is not None
    return lease


def heard(lease: file_backend.FileLease) -> bool:
    """Whether *lease* hears a take-over request now."""
    try:
        lease.refresh()
    except TakenOver:
        return True
    return False


@needs_root
def test_a_user_who_may_only_read_the_lock_file_cannot_ask_for_it(
    mallory: Runner, locks: Path, name: str
) -> None:
    """Root's lock file is 0644: mallory's --take-over cannot open it to ask (78); root holds on."""
    lease = file_lease(locks, name)
    (locks / f"{name}.lock").chmod(0o644)
    taker = mallory.lockrun("--uri", f"file://{locks}", "-n", name, "--take-over", "-w", "5",
                            "--", "true")  # fmt: skip
    assert taker.returncode == 78, taker.stderr
    assert "Permission denied" in one_line(taker.stderr)
    assert not heard(lease)
    lease.release()


@needs_root
def test_a_take_over_by_a_member_of_the_group_that_may_write_the_lock_file_is_heard(
    mallory: Runner, locks: Path, name: str
) -> None:
    """Root's lock file, 0664 in mallory's group: she may take it over, and is named."""
    lease = file_lease(locks, name)
    lock_file = locks / f"{name}.lock"
    os.chown(lock_file, 0, mallory.user.gid)
    lock_file.chmod(0o664)
    taker = mallory.popen(
        [mallory.python_path, "-m", "lockrun", "--uri", f"file://{locks}", "-n", name,
         "--take-over", "-w", "30", "--", "true"], stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_for(lambda: heard(lease), what="mallory's request")
        with pytest.raises(TakenOver) as taken:
            lease.refresh()
        said = f"{mallory.user.name}@{os.uname().nodename} pid {taker.pid}"
        assert str(taken.value) == f"taken over by {said}"
        lease.release()
        _, err = taker.communicate(timeout=30)
        assert (taker.returncode, err) == (0, "")
    finally:
        if taker.poll() is None:
            taker.kill()
            taker.communicate()


@needs_root
@pytest.mark.parametrize("made", ["root-0666", "mallory-0644", "mallory-0666"])
def test_a_request_in_a_lock_file_another_user_could_write_stops_no_one(
    mallory: Runner, locks: Path, name: str, made: str
) -> None:
    """Root's file open to all, or one mallory planted: her real request is not heard.

    She may take such a lock, not stop root's job: who else could write the file is who
    else could make a request there (docs/security.md).
    """
    lock_file = locks / f"{name}.lock"
    owner, mode = made.split("-")
    if owner == "mallory":
        assert (
            mallory.run(["sh", "-c", f": > {lock_file}; chmod {mode} {lock_file}"]).returncode == 0
        )
    lease = file_lease(locks, name)
    if owner == "root":
        lock_file.chmod(0o666)
    taker = mallory.popen(
        [mallory.python_path, "-m", "lockrun", "--uri", f"file://{locks}", "-n", name,
         "--take-over", "-w", "30", "--", "true"], stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        inode = f":{os.stat(lock_file).st_ino} "
        wait_for(
            lambda: any(
                inode in line and "OFDLCK" in line and "WRITE" in line
                for line in Path("/proc/locks").read_text().splitlines()
            ),
            what="mallory's request",
        )
        assert not heard(lease)
        lease.release()
        _, err = taker.communicate(timeout=30)
        assert (taker.returncode, err) == (0, "")  # she may take the lock, once it is free
    finally:
        if taker.poll() is None:
            taker.kill()
            taker.communicate()


@needs_root
@pytest.mark.parametrize("planted", ["symlink", "fifo", "file"])
def test_a_planted_stop_file_is_nothing_to_takers_and_holders(
    mallory: Runner, locks: Path, shared: Path, name: str, planted: str, held: Callable[..., Held]
) -> None:
    """NAME.stop as a link to root's file, a FIFO or mallory's flocked file: never read.

    Requests live in NAME.lock itself; a real take-over still works beside the plant.
    """
    precious = shared / "precious"
    precious.write_text(PRECIOUS)
    stop = locks / f"{name}.stop"
    plant = {
        "symlink": ["ln", "-s", str(precious), str(stop)],
        "fifo": ["mkfifo", "-m", "666", str(stop)],
        "file": ["sh", "-c", f"umask 0; : > {stop}"],
    }[planted]
    assert mallory.run(plant).returncode == 0
    flocking = None
    if planted == "file":
        flocking = mallory.popen(["flock", "-s", str(stop), "sleep", "60"])
        inode = f":{os.stat(stop).st_ino} "
        wait_for(lambda: inode in Path("/proc/locks").read_text(), what="mallory's flock")
    try:
        assert lockrun("--uri", f"file://{locks}", "-n", name, "--", "true").returncode == 0
        holder = held("--uri", f"file://{locks}", "-n", name)
        taker = lockrun("--uri", f"file://{locks}", "-n", name, "--take-over", "-w", "30",
                        "--", "true")  # fmt: skip
        assert (taker.returncode, taker.stderr) == (0, "")
        assert holder.process.wait(timeout=30) == 79
    finally:
        if flocking is not None:
            flocking.kill()
            flocking.wait()
    assert precious.read_text() == PRECIOUS


@needs_root
def test_a_symlink_planted_as_the_gate_of_a_lock_is_refused_when_waiting(
    mallory: Runner, locks: Path, shared: Path, name: str, held: Callable[..., Held]
) -> None:
    """A one-slot waiter passes NAME.gate now: a planted link there is 78, and never written."""
    precious = shared / "precious"
    precious.write_text(PRECIOUS)
    assert mallory.run(["ln", "-s", str(precious), str(locks / f"{name}.gate")]).returncode == 0
    assert lockrun("--uri", f"file://{locks}", "-n", name, "--", "true").returncode == 0
    holder = held("--uri", f"file://{locks}", "-n", name)
    waiter = lockrun("--uri", f"file://{locks}", "-n", name, "-w", "5", "--", "true")
    assert waiter.returncode == 78
    assert f"{locks / name}.gate" in one_line(waiter.stderr)
    assert holder.finish() == 0
    assert precious.read_text() == PRECIOUS


# -- abstract: squatted names of the modes it declines, and readers --------------------------

# Listen on each name of argv (pid "self": this process's) until stdin closes.
SQUAT = """
import os, socket, sys
socks = []
for name in sys.argv[1:]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\\0" + name.replace("self", str(os.getpid())))
    sock.listen(64)
    socks.append(sock)
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def squatting(runner: Runner, *names: str) -> Iterator[None]:
    """Have *runner* listen on abstract *names* during the block."""
    process = runner.python(SQUAT, *names, stdin=subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        yield
    finally:
        process.kill()
        process.communicate()


@pytest.fixture
def prefix() -> str:
    """Return an abstract: prefix of this test's own."""
    return f"hostile-modes-{os.getpid()}-{time.monotonic_ns()}"


@needs_root
def test_stop_requests_in_the_old_form_stop_nobody(
    mallory: Runner, prefix: str, name: str, held: Callable[..., Held]
) -> None:
    """abstract: has no --take-over (`Scheme.modes`): a request squatted by anyone is nothing."""
    base = abstract_backend._base(prefix, "default", name)
    uri = f"abstract:{prefix}"
    with squatting(mallory, f"{base}/x/1/1", f"{base}/x/1/self"):
        holder = held("--uri", uri, "-n", name)
        assert holder.process.poll() is None
        assert holder.finish() == 0
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert (result.returncode, result.stderr) == (0, "")


@needs_root
def test_forged_windows_and_readers_are_not_shown(
    mallory: Runner, prefix: str, name: str, held: Callable[..., Held]
) -> None:
    """A window's marker (abstract: has none now), a reader naming pid 1: neither believed."""
    base = abstract_backend._base(prefix, "default", name)
    uri = f"abstract:{prefix}"
    window = f"{base}/h0.1/{int(time.time() * 1000)}/1/u255s0"  # a window's, in the old form
    with squatting(mallory, window):
        result = lockrun("--uri", uri, "-n", name, "-w", "5", "--", "true")
        assert (result.returncode, result.stderr) == (0, "")  # no window held it
        holder = held("--uri", uri, "-n", name)
        busy = lockrun("--uri", uri, "-n", name, "--", "true")
        assert busy.returncode == 75
        assert "--hold-at-least" not in one_line(busy.stderr)
        assert holder.finish() == 0
    with squatting(mallory, f"{base}/r/1/1"):
        status = lockrun("status", "--uri", uri, "--json", name)
        assert json.loads(status.stdout)[0]["holders"] == []
        busy = lockrun("--uri", uri, "-n", name, "--", "true")  # a squatter holds it
        assert busy.returncode == 75, busy.stderr
        assert "busy" in one_line(busy.stderr)


# -- properties -----------------------------------------------------------------------------


@given(
    content=st.binary(max_size=300)
    | st.builds(
        lambda data, until: b"7\n" + json.dumps(data | {"until": until}).encode(),
        holder_like(),
        json_values | st.floats(allow_nan=True) | st.integers(min_value=-(2**70), max_value=2**70),
    )
)
def test_windows_in_lock_files_decode_within_bounds_or_are_none(content: bytes) -> None:
    """Whatever a co-user writes into a lock file: no window, or one within a year from now."""
    until = window_end(content, "sales")
    if until is not None:
        assert time.time() < until <= time.time() + MAX_WAIT + 86400


@given(name=st.text(max_size=120) | st.from_regex(abstract_backend._MARKER, fullmatch=True))
def test_abstract_names_of_anyone_decode_or_are_ignored(name: str) -> None:
    """Any name in the socket table: not ours, or a marker that describes without raising."""
    marker = abstract_backend._MARKER.fullmatch(name)
    if marker is not None:
        described = abstract_backend._described(marker, os.getpid())
        assert described.pid >= 0
