"""The file backend's pure parts: /proc/locks lines, slot files, records, take-over bytes."""

from __future__ import annotations

import fcntl
import json
import os
import select
import time
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun.backends import Holder, directories, flockwait, inotify, user_name
from lockrun.backends.file import records, takeover
from lockrun.backends.file.status import (
    NO_LOCKS,
    LockLine,
    Locks,
    Pid,
    classify,
    decode,
    lock_bases,
    once,
    proc_locks,
    read_slot,
)
from lockrun.bounds import MAX_WAIT
from lockrun.timing import now

if TYPE_CHECKING:
    from pathlib import Path

SDA1 = os.makedev(8, 1)

# -- /proc/locks: lines decoded into records ------------------------------------------------


@pytest.mark.parametrize(
    ("line", "decoded"),
    [
        (
            "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF",
            LockLine("FLOCK", blocked=False, shared=False, pid=1234, identity=(SDA1, 5678)),
        ),
        (
            "1: -> FLOCK  ADVISORY  READ  99 fd:00:42 0 EOF",
            LockLine("FLOCK", blocked=True, shared=True, pid=99, identity=(os.makedev(253, 0), 42)),
        ),
        (
            "7: POSIX  ADVISORY  READ  5 00:2e:7 0 0",
            LockLine("POSIX", blocked=False, shared=True, pid=5, identity=(os.makedev(0, 46), 7)),
        ),
        ("3: OFDLCK ADVISORY  WRITE -1 08:01:5678 4611686018427387904 4611686018427387904", None),
        ("4: LEASE  ACTIVE    READ  42 08:01:1 0 EOF", None),
        ("5: DELEG  ACTIVE    READ  42 08:01:1 0 EOF", None),
        ("", None),
        ("1:", None),
        ("1: ->", None),
        ("1: FLOCK ADVISORY WRITE 12", None),
        ("1: FLOCK ADVISORY WRITE x 08:01:1 0 EOF", None),
        ("1: FLOCK ADVISORY WRITE 1 08:01 0 EOF", None),
        ("1: FLOCK ADVISORY WRITE 1 08:01:2:3 0 EOF", None),
        ("1: FLOCK ADVISORY WRITE 1 zz:01:2 0 EOF", None),
        ("1: FLOCK ADVISORY WRITE 1 fffffffffff:01:2 0 EOF", None),  # past 32 bits
    ],
)
def test_proc_locks_lines_decode_into_records(line: str, decoded: LockLine | None) -> None:
    """FLOCK and POSIX lines become records; other kinds and broken lines none."""
    assert decode(line) == decoded


_HEX = st.integers(min_value=0, max_value=2**12 - 1).map(lambda n: f"{n:02x}")
_FIELD = st.sampled_from(["FLOCK", "POSIX", "OFDLCK", "LEASE", "->", "READ", "WRITE", "EOF"])
_WORD = _FIELD | st.text(max_size=12) | st.integers(-(2**70), 2**70).map(str) | _HEX


@given(st.text(max_size=120) | st.lists(_WORD, max_size=9).map(" ".join))
def test_any_line_decodes_to_a_record_or_is_skipped(line: str) -> None:
    """Whatever a line holds, decoding returns a record or None, never raises."""
    decoded = decode(line)
    assert decoded is None or decoded.kind in {"FLOCK", "POSIX"}


@given(
    kind=st.sampled_from(["FLOCK", "POSIX"]),
    blocked=st.booleans(),
    shared=st.booleans(),
    pid=st.integers(min_value=1, max_value=2**22),
    major=st.integers(min_value=0, max_value=4095),
    minor=st.integers(min_value=0, max_value=2**20 - 1),
    inode=st.integers(min_value=1, max_value=2**64 - 1),
)
def test_well_formed_lines_decode_to_what_they_say(
    kind: str, blocked: bool, shared: bool, pid: int, major: int, minor: int, inode: int
) -> None:
    """Each field of a line the kernel writes lands in its place in the record."""
    arrow = "-> " if blocked else ""
    mode = "READ " if shared else "WRITE"
    line = f"12: {arrow}{kind}  ADVISORY  {mode} {pid} {major:02x}:{minor:02x}:{inode} 0 EOF"
    identity = (os.makedev(major, minor), inode)
    assert decode(line) == LockLine(kind, blocked, shared, pid, identity)


# -- /proc/locks: records classified by file ------------------------------------------------


def flock(pid: int, *, shared: bool = False, blocked: bool = False, inode: int = 1) -> LockLine:
    return LockLine("FLOCK", blocked, shared, pid, (SDA1, inode))


def posix(pid: int, *, shared: bool = True, blocked: bool = False, inode: int = 1) -> LockLine:
    return LockLine("POSIX", blocked, shared, pid, (SDA1, inode))


def test_holders_and_waiters_are_told_apart_by_kind_and_arrow() -> None:
    """Held flocks, blocked flocks and POSIX read marks each land in their list, in order."""
    found = classify(
        [
            flock(10, shared=True),
            flock(11, shared=True),
            flock(20, blocked=True),
            flock(21, shared=True, blocked=True),
            posix(30),
            posix(31, shared=False),  # a POSIX write lock marks nothing
            posix(32, blocked=True),  # nor does a blocked one
            flock(40, inode=2),
        ]
    )
    assert found[(SDA1, 1)] == Locks(
        holding=[10, 11],
        waiting=[20, 21],
        readers=[10, 11],
        writers=[],
        shared_waiting=[21],
        marked=[30],
    )
    assert found[(SDA1, 2)] == Locks([40], [], [], [40], [], [])


def test_no_lines_no_locks() -> None:
    """An empty /proc/locks knows of no file."""
    assert classify([]) == {}


@given(
    st.lists(
        st.builds(
            LockLine,
            st.sampled_from(["FLOCK", "POSIX"]),
            st.booleans(),
            st.booleans(),
            st.integers(min_value=1, max_value=50),
            st.tuples(st.just(SDA1), st.integers(min_value=1, max_value=3)),
        ),
        max_size=30,
    )
)
def test_classified_lists_partition_the_flock_lines(lines: list[LockLine]) -> None:
    """Every held flock is a reader or a writer; every blocked one a waiter; shared ones marked."""
    for identity, entry in classify(lines).items():
        mine = [line for line in lines if line.identity == identity]
        flocks = [line for line in mine if line.kind == "FLOCK"]
        assert entry.holding == [line.pid for line in flocks if not line.blocked]
        assert entry.waiting == [line.pid for line in flocks if line.blocked]
        assert sorted(entry.readers + entry.writers) == sorted(entry.holding)
        assert set(entry.shared_waiting) <= set(entry.waiting)
        posix_reads = [line for line in mine if line.kind == "POSIX" and line.shared]
        assert entry.marked == [line.pid for line in posix_reads if not line.blocked]


def test_our_own_flock_shows_in_proc_locks(tmp_path: Path) -> None:
    """The real /proc/locks decodes: a flock of ours is found by the file's identity."""
    fd = os.open(tmp_path / "x.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        info = os.fstat(fd)
        assert os.getpid() in proc_locks()[(info.st_dev, info.st_ino)].writers
    finally:
        os.close(fd)


# -- a slot file's holders and waiters ------------------------------------------------------


def record(name: str = "sales", slots: int = 1) -> records.Record:
    return records.Record(Holder("h", 7, "u", ("true",)), name, slots)


def test_a_recorded_holder_is_the_record_and_waiters_queue_on_slot_zero() -> None:
    """A writer with a record holds; the pids blocked on NAME.lock wait, readers marked."""
    entry = Locks([7], [8, 9], [], [7], [9], [])
    assert read_slot(0, entry, record(), window=False) == (
        record(),
        (),
        (Pid(8, shared=False), Pid(9, shared=True)),
    )


def test_only_slot_zero_has_waiters_in_the_kernel() -> None:
    """A semaphore's other slots queue nobody: its waiters are on NAME.gate."""
    entry = Locks([7], [8], [], [7], [], [])
    assert read_slot(1, entry, record(), window=False).waiters == ()


def test_readers_are_named_by_the_kernel_not_by_a_record() -> None:
    """Shared holders write no record: each holding pid is a shared holder of the slot."""
    entry = Locks([3, 4], [], [3, 4], [], [], [])
    found = read_slot(0, entry, record(), window=False)
    assert found == (None, (Pid(3, shared=True, slot=0), Pid(4, shared=True, slot=0)), ())


def test_a_holder_without_a_record_is_the_first_pid() -> None:
    """flock(1), or a record not believed: the kernel's first holder holds the slot."""
    entry = Locks([5], [], [], [5], [], [])
    assert read_slot(2, entry, None, window=False) == (None, (Pid(5, shared=False, slot=2),), ())


def test_a_record_nobody_holds_is_no_holder() -> None:
    """A record left behind by a killed holder names nobody once its flock is gone."""
    assert read_slot(0, NO_LOCKS, record(), window=False) == (None, (), ())


def test_in_a_window_the_flock_holder_is_first_in_line() -> None:
    """An open --hold-at-least window holds; whoever has the flock waits it out, ahead of all."""
    entry = Locks([6], [8], [6], [], [], [])
    found = read_slot(0, entry, record(), window=True)
    assert found == (record(), (), (Pid(6, shared=True), Pid(8, shared=False)))


def test_waiters_are_listed_once_and_never_as_holders() -> None:
    """The head is in both gate and lock; a holder is no waiter."""
    waiters = [
        Pid(1, shared=False),
        Pid(2, shared=True),
        Pid(1, shared=False),
        Pid(3, shared=False),
    ]
    assert once(waiters, {3}) == [Pid(1, shared=False), Pid(2, shared=True)]


def test_status_finds_the_locks_of_one_namespace_among_a_directorys_files() -> None:
    """Slot files of the namespace count; gates, fences, strangers and other namespaces not."""
    entries = ["sales.lock", "sales~2.lock", "jobs.gate", "x.fence", "ns.jobs.lock", "README"]
    assert lock_bases(entries, records.DEFAULT_NAMESPACE) == {"sales"}
    assert lock_bases(entries, "ns") == {"ns.jobs"}
    assert lock_bases(entries, "other") == set()


# -- slot files: names, counters, records, windows ------------------------------------------


def test_a_lock_base_names_its_namespace_and_name() -> None:
    """NAME in the default namespace, NAMESPACE.NAME elsewhere; slot i beyond 0 is NAME~i."""
    assert records.lock_base("default", "sales") == "sales"
    assert records.lock_base("ns", "sales") == "ns.sales"
    assert (records.namespace_of("ns.sales"), records.name_of("ns.sales")) == ("ns", "sales")
    assert (records.namespace_of("sales"), records.name_of("sales")) == ("default", "sales")
    assert (records.slot_file("ns.sales", 0), records.slot_file("ns.sales", 3)) == (
        "ns.sales.lock",
        "ns.sales~3.lock",
    )


@given(namespace=st.text(min_size=1, max_size=300), name=st.text(min_size=1, max_size=300))
def test_long_names_are_cut_to_a_base_that_fits_a_file_name(namespace: str, name: str) -> None:
    """Any name gives a base that leaves room for ~NNN.lock; another name, another base."""
    base = records.lock_base(namespace, name)
    assert len(records.slot_file(base, 999).encode()) <= 255
    assert "/" not in base
    assert records.lock_base(namespace, name + "x") != base


def test_a_slot_file_splits_into_its_counter_and_its_record() -> None:
    """The first line is the fence counter only if it is all digits."""
    assert records.split(b"12\n{}\n") == (b"12", b"{}\n")
    assert records.split(b"12") == (b"", b"12")  # no newline: a pid flock(1)'s user wrote
    assert records.split(b"x1\n{}") == (b"", b"x1\n{}")
    assert records.counter_line(b"12\n{}\n") == b"12\n"
    assert records.counter_line(b"{}") == b""


def slot_content(name: str = "sales", **fields: object) -> bytes:
    data = {"name": name, "namespace": "default", "slots": 1} | Holder.me(["true"]).to_dict()
    return b"3\n" + json.dumps(data | fields).encode() + b"\n"


def test_a_record_counts_only_in_the_file_of_the_lock_it_names() -> None:
    """A well-formed record of another lock, or with slots out of bounds, is none."""
    found = records.read_record(slot_content(), "sales")
    assert found is not None
    assert (found.name, found.slots, found.holder.pid) == ("sales", 1, os.getpid())
    assert records.read_record(slot_content(), "other") is None
    assert records.read_record(slot_content(slots=0), "sales") is None
    assert records.read_record(slot_content(slots=True), "sales") is None
    assert records.read_record(b"3\n", "sales") is None


def test_a_window_marker_sets_until_and_keeps_the_counter() -> None:
    """What release leaves for --hold-at-least: the same record with its end."""
    until = time.time() + 60
    marked = records.window_marker(slot_content(), until)
    assert marked.startswith(b"3\n")
    assert records.window_end(marked, "sales") == until


def test_windows_past_their_end_or_too_far_off_are_none() -> None:
    """A window over, or ending further off than any lockrun makes, holds nothing."""
    assert records.window_end(slot_content(until=time.time() - 1), "sales") is None
    too_far = time.time() + MAX_WAIT + 86400 + 60
    assert records.window_end(slot_content(until=too_far), "sales") is None
    assert records.window_end(slot_content(), "sales") is None


def test_waiting_out_no_window_or_one_past_the_deadline_is_immediate() -> None:
    """No window: go at once; a window ending after the deadline: busy at once."""
    started = now()
    assert records.wait_out(None, None)
    assert not records.wait_out(time.time() + 60, now() + 0.01)
    assert records.wait_out(time.time() + 0.01, None)
    assert now() - started < 1


# -- take-over requests: the byte that says who asks ----------------------------------------


@given(uid=st.integers(min_value=0, max_value=2**32 - 1), pid=st.integers(1, 2**22 - 1))
def test_a_request_byte_says_who_asks(uid: int, pid: int) -> None:
    """The user and pid a taker puts in its byte are what its holders read back."""
    found = (fcntl.F_WRLCK, os.SEEK_SET, takeover.request_byte(uid, pid), 1, 0)
    assert takeover.asker(found) == f"{user_name(uid)}@{os.uname().nodename} pid {pid}"


def test_locks_that_are_no_requests_ask_nothing() -> None:
    """A read lock, a lock below the request range or a longer one is nobody's request."""
    start = takeover.request_byte(0, 1)
    assert takeover.asker((fcntl.F_UNLCK, 0, 0, 0, 0)) is None
    assert takeover.asker((fcntl.F_RDLCK, 0, start, 1, 0)) is None
    assert takeover.asker((fcntl.F_WRLCK, 0, 0, 1, 0)) is None
    assert takeover.asker((fcntl.F_WRLCK, 0, start, 2, 0)) is None


def test_a_touch_rings_the_bell_and_draining_quiets_it(tmp_path: Path) -> None:
    """inotify: a taker's utime makes the holders' bell readable, once."""
    fd = os.open(tmp_path / "x.lock", os.O_RDWR | os.O_CREAT, 0o600)
    bell = takeover.bell(fd)
    try:
        assert bell is not None
        takeover.ring(fd)
        assert select.select([bell], [], [], 1)[0] == [bell]
        inotify.drain(bell)
        assert select.select([bell], [], [], 0)[0] == []
    finally:
        os.close(fd)
        if bell is not None:
            os.close(bell)


# -- flock(2) waits ---------------------------------------------------------------------------


def test_a_timed_wait_without_signals_gives_up_then_gets_a_freed_lock(tmp_path: Path) -> None:
    """The Python API's wait: False at its deadline, True once the holder closes the file."""
    path = tmp_path / "x.lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    waiter = os.open(path, os.O_RDWR)  # another open file: flock(2) locks exclude each other
    try:
        assert flockwait.try_flock(holder)
        assert not flockwait.try_flock(waiter)
        assert not flockwait.signals_claimed()
        started = now()
        assert not flockwait.wait_flock(waiter, now() + 0.05)
        assert 0.05 <= now() - started < 1
        assert not flockwait.wait_flock(waiter, now() - 1)
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert flockwait.wait_flock(waiter, now() + 1)
        assert flockwait.try_flock(waiter, fcntl.LOCK_SH)  # ours: converts, never blocks
    finally:
        os.close(waiter)
        os.close(holder)


# -- lock directories: the path walk's pure parts -------------------------------------------


def test_a_path_walks_through_its_names_only() -> None:
    """Empty components and "." are skipped; ".." is a name the kernel resolves."""
    assert directories._components("//var/./lock//app/") == ["var", "lock", "app"]
    assert directories._components("../x") == ["..", "x"]
    assert directories._components("/") == []


@pytest.mark.parametrize(
    ("walked", "top", "below"),
    [
        ("", "/", True),
        ("/home", "/home", True),
        ("/home/me", "/home", True),
        ("/homework", "/home", False),
        ("/", "/home", False),
        ("/home", None, False),
    ],
)
def test_only_directories_below_make_below_are_made(
    walked: str, top: str | None, below: bool
) -> None:
    """The next component may be made only below *make_below*, never beside it."""
    assert directories._under(walked, top) is below
