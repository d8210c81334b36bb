"""The ``file:`` backend: the slot files of locks flock(2)ed in one directory (A1, A2)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import TYPE_CHECKING, Final

from lockrun.backends import (
    MAX_RECORD,
    Holder,
    LockState,
    Request,
    next_fence,
    slots_mismatch,
    write_json,
)
from lockrun.backends.directories import failure
from lockrun.backends.file.directory import Held, LockDirectory, closed_on_error
from lockrun.backends.file.lease import FileLease
from lockrun.backends.file.records import (
    lock_base,
    overwrite,
    read_record,
    sha256,
    slot_file,
    split,
    wait_out,
    window_end,
)
from lockrun.backends.file.takeover import ask_to_stop, ring, taken_by, taker, unask
from lockrun.backends.flockwait import SLOW_WAKE, try_flock, wait_flock
from lockrun.bounds import MAX_SLOTS
from lockrun.errors import TakenOver
from lockrun.timing import now

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

_SINCE_AND_SLOT: Final = ', "since": null, "slot": null'  # what _record_line fills in


class FileBackend:
    """Locks as flock(2)ed files in one directory."""

    def __init__(
        self,
        directory: str,
        *,
        private: bool,
        make_below: str,
        warn: Callable[[str], None] | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        """Use *directory*, making what is missing below *make_below* on first use.

        *private*: the default directory, which must be ours and is kept 0700. *warn* gets
        a take-over that could not be asked for, *note* what `-v` shows: records not
        believed.
        """
        self.directory = directory
        self.private = private
        self.make_below = make_below
        self._files = LockDirectory(directory, private=private, make_below=make_below, note=note)
        self._warn = warn
        self._head: tuple[tuple[object, ...], str, str] | None = None  # see _record_parts

    def acquire(self, request: Request, deadline: float | None) -> FileLease | None:
        """Take one slot of *request*, queueing FIFO in the kernel until *deadline*."""
        base = lock_base(request.namespace, request.name)
        self._files.opened()  # opened, or checked to be still the one its path names
        if request.slots == 1:
            return self._acquire_lock(base, request, deadline)
        self._check_agreement(base, request)
        # The gate is closed once the fence is drawn (docs/design.md A2). A take-over is
        # of one slot only (docs/semantics.md "Fleet modes"): a semaphore has none.
        with contextlib.ExitStack() as gate:
            taken = self._wait_for_slot(base, request, deadline, gate)
            if taken is None:
                return None
            slot, held, wake = taken
            with closed_on_error(held.fd):
                return self._grant(base, request, slot, held, wake)

    def _wait_for_slot(
        self,
        base: str,
        request: Request,
        deadline: float | None,
        line: contextlib.ExitStack,
    ) -> tuple[int, Held, socket.socket | None] | None:
        """Queue on NAME.gate, then take a slot as the head (docs/design.md A2).

        *line* closes the gate.
        """
        gate = self._gate(base, line)  # its close: the next waiter in the queue is the head
        # A one-shot try still waits briefly on the gate: its holder may only be sweeping.
        if not wait_flock(gate, _with_grace(deadline)):
            return None
        return self._take_slot(base, request.slots, deadline)

    def _gate(self, base: str, line: contextlib.ExitStack) -> int:
        """Open NAME.gate, which *line* closes."""
        gate = self._files.open(f"{base}.gate").fd
        line.callback(os.close, gate)
        return gate

    def _acquire_lock(
        self, base: str, request: Request, deadline: float | None
    ) -> FileLease | None:
        """Take the one slot of a lock: flock(2) on NAME.lock, LOCK_SH if shared (A1)."""
        held = self._files.open(slot_file(base, 0))
        try:  # not `closed_on_error`: a `with` costs the Python API's cycle a tenth (#32)
            return self._lock_file(base, request, held, deadline)
        except BaseException:  # Ctrl-C included: no lock left behind
            with contextlib.suppress(OSError):
                os.close(held.fd)
            raise

    def _lock_file(
        self, base: str, request: Request, held: Held, deadline: float | None
    ) -> FileLease | None:
        """Lock NAME.lock, open as *held*, and grant it; None (closed) if *deadline* passed."""
        # Slot files beyond the first are a semaphore's: one in use would be a mismatch.
        semaphore = self._check_agreement(base, request, first=1)
        # The uncontended writer takes the lock and touches no other file; a reader must
        # first see in the gate that no writer waits.
        if request.shared or not try_flock(held.fd):
            with contextlib.ExitStack() as line:  # the gate and a take-over request, if any
                if not self._wait_in_line(base, request, held, deadline, line):
                    os.close(held.fd)
                    return None
        content = self._content(held, request)
        if not wait_out(window_end(self._files.believed(held, content), base), deadline):
            os.close(held.fd)
            return None
        if (asker := taker(held.fd)) is not None:
            raise TakenOver(taken_by(asker))  # a later acquirer asked: give way
        if request.shared:  # no record, no fence: others share the file
            return FileLease(0, None, held, None)
        return self._grant(base, request, 0, held, None, semaphore=semaphore, content=content)

    def _wait_in_line(
        self,
        base: str,
        request: Request,
        held: Held,
        deadline: float | None,
        line: contextlib.ExitStack,
    ) -> bool:
        """Queue on NAME.gate, then wait on NAME.lock as the head; True once it is ours.

        Every lockrun waiter passes the gate, which the kernel grants in arrival order, and
        only its holder waits on the lock: flock(2) lets a new LOCK_SH pass a waiting
        LOCK_EX [V], so a reader that came after a queued writer would overtake it. What
        *line* closes, the caller closes once the lock is ours (docs/design.md A1).
        """
        gate = self._gate(base, line) if request.shared else None
        if gate is not None and try_flock(gate) and try_flock(held.fd, fcntl.LOCK_SH):
            return True  # no writer holds it, none waits: in beside the other readers
        content = self._files.believed(held, self._content(held, request))
        self._agree(base, request, held.identity, content)
        self._record_parts(request)  # now, not after the wait
        if deadline is not None and deadline <= now() and not request.shared:
            return False  # a one-shot writer: busy
        if gate is None:
            gate = self._gate(base, line)
        return self._queue(request, held, gate, deadline, line)

    def _queue(
        self,
        request: Request,
        held: Held,
        gate: int,
        deadline: float | None,
        line: contextlib.ExitStack,
    ) -> bool:
        """Wait for the *gate*, then for the lock file *held* as the head; True once it is ours.

        A --take-over request is made first, and lasts until *line* closes.
        """
        if request.take_over:
            self._ask_to_stop(request, held, line)
        if not request.shared:
            return wait_flock(gate, deadline) and wait_flock(held.fd, deadline)
        # A mark for status: a POSIX lock, which no flock(2) sees (P17).
        with contextlib.suppress(OSError):
            fcntl.lockf(gate, fcntl.LOCK_SH | fcntl.LOCK_NB, 1)
        # A one-shot reader waits briefly for a gate held by a reader on its way in.
        return wait_flock(gate, _with_grace(deadline)) and wait_flock(
            held.fd, deadline, fcntl.LOCK_SH
        )

    def _ask_to_stop(self, request: Request, held: Held, line: contextlib.ExitStack) -> None:
        """Ask the holders of *held* to give way (--take-over) until *line* closes; ring them."""
        if not ask_to_stop(held.fd) and self._warn is not None:
            self._warn(
                f"{request.name}: --take-over: cannot ask the holders of {held.path} to "
                "give way: another process holds a lock over the bytes a request takes "
                "(a reader of the file may); waiting as any waiter"
            )
        line.callback(unask, held.fd)  # before we look for requests of others
        ring(held.fd)  # the bell; refreshes would see the request anyway

    def _content(self, held: Held, request: Request) -> bytes:
        """Return what the slot file *held* holds: a counter line and a record, if any."""
        try:
            return os.pread(held.fd, MAX_RECORD + 1, 0)
        except OSError as err:  # EIO
            raise failure(f"lock files of {request.name} in {self.directory}", err) from err

    def _check_agreement(self, base: str, request: Request, first: int = 0) -> bool:
        """Raise `ConfigError` (78) if a live holder of this name uses another --slots.

        Looks at the slot files from *first* up to the first missing one; says whether
        there was any.
        """
        for slot in range(first, MAX_SLOTS):
            if not self._files.exists(slot_file(base, slot)):  # as a rule, NAME~1.lock
                return slot > first
            identity, content = self._files.peek(slot_file(base, slot))
            if identity is None:
                return slot > first
            self._agree(base, request, identity, content)
        return True

    def _agree(
        self, base: str, request: Request, identity: tuple[int, int], content: bytes
    ) -> None:
        """Raise `ConfigError` if *content* is a live holder's record with another --slots.

        Live: its writer holds the file exclusively, or its --hold-at-least window is open.
        """
        record = read_record(content, base)
        if record is None or record.slots == request.slots:
            return
        from lockrun.backends.file.status import NO_LOCKS, proc_locks  # noqa: PLC0415 - rare

        locks = proc_locks()  # only when a record disagrees: is its writer still there?
        if locks.get(identity, NO_LOCKS).writers or window_end(content, base) is not None:
            raise slots_mismatch(request, record.slots, record.holder)

    def _take_slot(
        self, base: str, slots: int, deadline: float | None
    ) -> tuple[int, Held, socket.socket | None] | None:
        """As the head of the queue, lock the first free slot file, sleeping between sweeps."""
        from lockrun.backends import abstract  # noqa: PLC0415 - semaphores only

        files: list[Held] = []
        winner = None
        try:
            # One at a time: those opened before a failure are closed below.
            files.extend(self._files.open(slot_file(base, slot)) for slot in range(slots))
            wake_names = self._wake_names(base, slots)
            pause = abstract.TRANSITION
            while (winner := _first_free(files)) is None:
                wait = abstract.remaining(deadline)
                if wait == 0:
                    return None
                pause = _nap(wake_names, wait, pause)
            return winner, files[winner], abstract.bind_listener(wake_names[winner])
        finally:
            for slot, held in enumerate(files):
                if slot != winner:
                    os.close(held.fd)

    def _wake_names(self, base: str, slots: int) -> list[str]:
        """Name each slot's wake-up socket: this directory's inode and the lock's base."""
        device, inode = self._files.identity
        digest = sha256(f"{device}:{inode}/{base}")
        return [f"lockrun-file/{digest[:40]}/{slot}" for slot in range(slots)]

    def _grant(
        self,
        base: str,
        request: Request,
        slot: int,
        held: Held,
        wake: socket.socket | None,
        *,
        semaphore: bool = False,
        content: bytes | None = None,
    ) -> FileLease:
        """Draw the fence and write it and the holder into the slot file; we hold its lock.

        The fence counter is the first line of NAME.lock, where a lock keeps it. A
        semaphore's head draws under the gate, from NAME.fence and that line, and keeps
        it in NAME.fence; so a lock reads NAME.fence too when a semaphore has used its
        name (*semaphore*: slot files beside NAME.lock), or when NAME.lock has no counter
        line (a new file, or one an older lockrun or a flock(1) user wrote). *content* is
        the file's, if the caller has read it since it was locked.
        """
        try:
            if content is None:
                content = os.pread(held.fd, MAX_RECORD + 1, 0)
            counter = split(content)[0]
            if request.slots > 1:
                fence = self._semaphore_fence(base, counter if slot == 0 else None)
            else:
                fence = next_fence(counter)
                if semaphore or not counter:
                    fence = max(fence, next_fence(self._files.read(f"{base}.fence")))
            line = f"{fence}\n"
            data = f"{line}{self._record_line(request, slot)}\n".encode()
            if not held.written:  # no record: status names the holder from /proc/locks
                return FileLease(slot, fence, held, wake)
            # A longer record was there (a blanked one, as a rule): blank what is left of it.
            # Blanks, not a truncate: the file keeps its size, which a truncate and the next
            # write past its end cost the kernel several µs a cycle (issue #32).
            left = len(content) - len(data)
            os.pwrite(held.fd, data + b" " * left if 0 < left <= _BLANKS else data, 0)
            if left > _BLANKS:  # someone else's long file: cut it
                os.ftruncate(held.fd, len(data))
            else:
                data += b" " * max(0, left)
        except OSError as err:  # ENOSPC, EIO: we could not record the fence
            raise failure(f"lock files of {request.name} in {self.directory}", err) from err
        # Not held._replace: a NamedTuple's _replace is a tenth of the API's cycle (#32).
        kept = Held(held.path, held.fd, held.identity, len(line), data, held.written)
        return FileLease(slot, fence, kept, wake)

    def _semaphore_fence(self, base: str, counter: bytes | None) -> int:
        """Draw a semaphore's fence (as its head) and keep it in NAME.fence.

        Above NAME.fence and NAME.lock's counter line, whose *counter* the caller has
        read if it holds that file.
        """
        if counter is None:
            counter = split(self._files.peek(slot_file(base, 0))[1])[0]
        fence_file = self._files.open(f"{base}.fence")
        try:
            fence = max(next_fence(os.pread(fence_file.fd, 32, 0)), next_fence(counter))
            if fence_file.written:
                overwrite(fence_file.fd, f"{fence}\n".encode())
        finally:
            os.close(fence_file.fd)
        return fence

    def _record_line(self, request: Request, slot: int) -> str:
        """Return the holder record of *request* in *slot*: one line of JSON."""
        head, tail = self._record_parts(request)
        return f'{head}, "since": {time.time()!r}, "slot": {slot}{tail}'

    def _record_parts(self, request: Request) -> tuple[str, str]:
        """Return the JSON of *request*'s holder record around its time and slot.

        Encoded once per backend while the request stays the same, and before a wait, so
        that a hand-over only fills in the time and the slot.
        """
        holder = request.holder
        # All but its time, which changes at each acquisition (tuples: _replace is dear).
        fixed = (
            request.namespace,
            request.name,
            request.slots,
            holder[:_SINCE],
            holder[_SINCE + 1 :],
        )
        if self._head is None or self._head[0] != fixed:
            record: dict[str, object] = {"name": request.name, "namespace": request.namespace}
            record |= {"slots": request.slots} | holder._replace(since=None).to_dict()
            # Holder's fields end with since, slot, expires (tests/backends/test_file.py
            # holds the record to json.dumps's).
            head, _, tail = write_json(record).rpartition(_SINCE_AND_SLOT)
            self._head = (fixed, head, tail)
        return self._head[1:]

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders (from the slot files) and waiters (from /proc/locks).

        Makes nothing: a directory that does not exist holds no locks.
        """
        from lockrun.backends.file.status import states  # noqa: PLC0415 - `status` only

        return states(self._files, namespace, name)

    def close(self) -> None:
        """Close the directory."""
        self._files.close()


_SINCE: Final = Holder._fields.index("since")
_BLANKS: Final = 4096  # a longer leftover than this is cut, not blanked


def _with_grace(deadline: float | None) -> float | None:
    """Return the deadline of a wait on a gate: a one-shot try too waits for a passing head."""
    from lockrun.backends.abstract import GATE_GRACE  # noqa: PLC0415 - waiters only

    return None if deadline is None else max(deadline, now() + GATE_GRACE)


def _first_free(files: list[Held]) -> int | None:
    """Lock the first free slot file of *files*; return its slot (None: all are held)."""
    for slot, held in enumerate(files):
        if try_flock(held.fd):
            return slot
    return None


def _nap(wake_names: list[str], wait: float, pause: float) -> float:
    """Sleep until a slot's holder hangs up, or *wait* passes; return the next *pause*.

    A holder without a wake-up socket (flock(1), a child) is looked at again after
    *pause*, doubled each time up to SLOW_WAKE.
    """
    from lockrun.backends import abstract  # noqa: PLC0415 - semaphores only

    conns = [abstract.connect_to(name) for name in wake_names]
    live = [conn for conn in conns if conn is not None]
    if len(live) < len(wake_names):
        wait, pause = min(wait, pause), min(pause * 2, SLOW_WAKE)
    else:
        pause = abstract.TRANSITION
    try:
        abstract.wait_readable(live, wait)
    finally:
        for conn in live:
            conn.close()
    return pause
