"""Who holds and who waits for ``file:`` locks: the slot files' records and /proc/locks.

/proc/locks is read once per status; its lines are decoded into `LockLine` records
(`decode`), then sorted by file (`classify`), then each slot file's holders and waiters are
told apart (`read_slot`). All three are pure, for forged lines to be fed to them.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.backends import Holder, LockState, describe_pid
from lockrun.backends.file.records import (
    LOCK_FILE,
    Record,
    lock_base,
    name_of,
    namespace_of,
    read_record,
    slot_file,
    window_end,
)
from lockrun.bounds import MAX_SLOTS
from lockrun.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from lockrun.backends.file.directory import LockDirectory

_FIELDS: Final = 5  # KIND ADVISORY|MANDATORY READ|WRITE PID MAJ:MIN:INODE (then START END)


class LockLine(NamedTuple):
    """One flock(2) or POSIX lock of /proc/locks."""

    kind: str  # "FLOCK" or "POSIX" (an OFD lock, OFDLCK, is never one of ours to report)
    blocked: bool  # "->": a waiter, blocked on the lock of the line before
    shared: bool  # READ (LOCK_SH, F_RDLCK); WRITE otherwise
    pid: int
    identity: tuple[int, int]  # the file's (st_dev, st_ino)


def decode(line: str) -> LockLine | None:
    """Decode a line of /proc/locks; None for other kinds of lock and what does not parse.

    A line: ``N: [->] FLOCK|POSIX|OFDLCK ADVISORY READ|WRITE PID MAJ:MIN:INODE START END``.
    """
    fields = line.split()
    blocked = fields[1:2] == ["->"]
    fields = fields[2:] if blocked else fields[1:]
    if len(fields) < _FIELDS or fields[0] not in {"FLOCK", "POSIX"}:
        return None
    try:
        major, minor, inode = fields[4].split(":")
        identity = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        pid = int(fields[3])
    except (ValueError, OverflowError):  # OverflowError: a device number past 32 bits
        return None
    return LockLine(fields[0], blocked, fields[2] == "READ", pid, identity)


class Locks(NamedTuple):
    """What /proc/locks says of one file: pids, in the order it lists them."""

    holding: list[int]  # a flock(2) lock held, either kind
    waiting: list[int]  # blocked in flock(2)
    readers: list[int]  # of those holding: LOCK_SH
    writers: list[int]  # of those holding: LOCK_EX
    shared_waiting: list[int]  # of those waiting: LOCK_SH
    marked: list[int]  # POSIX read locks: on NAME.gate, the marks of shared waiters


NO_LOCKS: Final = Locks([], [], [], [], [], [])


def classify(lines: Iterable[LockLine]) -> dict[tuple[int, int], Locks]:
    """Map each file's (st_dev, st_ino) to the pids holding and waiting for locks on it."""
    found: dict[tuple[int, int], Locks] = {}
    for lock in lines:
        entry = found.setdefault(lock.identity, Locks([], [], [], [], [], []))
        if lock.kind == "POSIX":
            if lock.shared and not lock.blocked:
                entry.marked.append(lock.pid)
        elif lock.blocked:
            entry.waiting.append(lock.pid)
            if lock.shared:
                entry.shared_waiting.append(lock.pid)
        else:
            entry.holding.append(lock.pid)
            (entry.readers if lock.shared else entry.writers).append(lock.pid)
    return found


def proc_locks() -> dict[tuple[int, int], Locks]:
    """Map (st_dev, st_ino) to the pids holding and waiting for locks, from /proc/locks."""
    with open("/proc/locks", encoding="ascii", errors="replace") as table:
        lines = table.read().splitlines()
    return classify(lock for line in lines if (lock := decode(line)) is not None)


class Pid(NamedTuple):
    """A process that /proc/locks names as a holder or a waiter, to be described from /proc."""

    pid: int
    shared: bool
    slot: int | None = None


class Slot(NamedTuple):
    """Who holds and waits for one slot file, as its record and /proc/locks say."""

    record: Record | None  # the holder by its record: it holds the slot, or its window does
    holders: tuple[Pid, ...]  # the holders /proc/locks alone names
    waiters: tuple[Pid, ...]


def read_slot(slot: int, entry: Locks, record: Record | None, *, window: bool) -> Slot:
    """Tell the holders of *slot* from its waiters, given its *record* and *entry*.

    *window*: the record is an open --hold-at-least window's, whose run holds the slot;
    whoever has the flock waits out the window (docs/design.md A1): the first in line.
    Shared holders write no record: the kernel's word names them. Only slot 0 has waiters
    in the kernel; a semaphore's queue on NAME.gate.
    """
    queued: tuple[Pid, ...] = ()
    if slot == 0:
        queued = tuple(Pid(pid, pid in entry.shared_waiting) for pid in entry.waiting)
    if window:
        ahead = tuple(Pid(pid, pid in entry.readers) for pid in entry.holding)
        return Slot(record, (), ahead + queued)
    if entry.readers:
        return Slot(None, tuple(Pid(pid, shared=True, slot=slot) for pid in entry.readers), queued)
    if not entry.holding:
        return Slot(None, (), queued)
    if record is None:  # flock(1)'s, or a record not believed: the kernel names the holder
        return Slot(None, (Pid(entry.holding[0], shared=False, slot=slot),), queued)
    return Slot(record, (), queued)


def once(waiters: Iterable[Pid], seen: set[int]) -> list[Pid]:
    """Return *waiters* without holders (*seen*) and repeats: the head is in gate and lock."""
    kept = []
    for waiter in waiters:
        if waiter.pid not in seen:
            seen.add(waiter.pid)
            kept.append(waiter)
    return kept


def lock_bases(entries: Iterable[str], namespace: str) -> set[str]:
    """Return the file-name stems of the locks of *namespace* among a directory's *entries*."""
    bases = set()
    for entry in entries:
        match = re.fullmatch(LOCK_FILE, entry)
        if match is not None and namespace_of(match["base"]) == namespace:
            bases.add(match["base"])
    return bases


def states(directory: LockDirectory, namespace: str, name: str | None) -> list[LockState]:
    """Report holders (from the slot files) and waiters (from /proc/locks).

    Makes nothing: a directory that does not exist holds no locks.
    """
    try:
        fd = directory.opened(make=False)
    except ConfigError as err:
        if not isinstance(err.__cause__, FileNotFoundError):
            raise
        if name is None:
            return []
        return [LockState(namespace, name, directory.path(f"{lock_base(namespace, name)}.lock"))]
    if name is not None:
        bases = {lock_base(namespace, name)}
    else:
        bases = lock_bases(os.listdir(fd), namespace)
    locks = proc_locks()
    found = [_state(directory, base, namespace, name, locks) for base in sorted(bases)]
    return [state for state in found if name is not None or state.holders or state.waiters]


def _state(
    directory: LockDirectory,
    base: str,
    namespace: str,
    name: str | None,
    locks: dict[tuple[int, int], Locks],
) -> LockState:
    holders, waiters, last = _slots(directory, base, locks)
    gate_identity, _ = directory.peek(f"{base}.gate")
    if gate_identity is not None:
        gate = locks.get(gate_identity, NO_LOCKS)
        waiters += [Pid(pid, pid in gate.marked) for pid in (*gate.holding, *gate.waiting)]
    lock_name, slots = (name or name_of(base), None) if last is None else (last.name, last.slots)
    seen = {holder.pid for holder in holders}
    return LockState(
        namespace,
        lock_name,
        directory.path(f"{base}.lock"),
        slots,
        tuple(holders),
        tuple(_described(waiter) for waiter in once(waiters, seen)),
    )


def _slots(
    directory: LockDirectory, base: str, locks: dict[tuple[int, int], Locks]
) -> tuple[list[Holder], list[Pid], Record | None]:
    """Return the holders and waiters of each slot file of *base*, and the last record read."""
    holders: list[Holder] = []
    waiters: list[Pid] = []
    last = None
    for slot in range(MAX_SLOTS):
        identity, content = directory.peek(slot_file(base, slot))
        if identity is None:
            break
        record = read_record(content, base)
        window = record is not None and window_end(content, base) is not None
        found = read_slot(slot, locks.get(identity, NO_LOCKS), record, window=window)
        if found.record is not None:
            holders.append(found.record.holder)
            last = found.record
        holders += [_described(pid) for pid in found.holders]
        waiters += found.waiters
    return holders, waiters, last


def _described(process: Pid) -> Holder:
    return describe_pid(process.pid)._replace(shared=process.shared, slot=process.slot)
