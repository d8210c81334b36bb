"""The guardian: a forked process that stops the command's group when lockrun cannot.

docs/design.md A11 describes it, and the kernel's dead man's switch beside it (`_arm`).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import math
import os
import select
import signal
import struct
import time
from typing import TYPE_CHECKING, Final, NoReturn

from lockrun.processes import kill_the_others
from lockrun.sigmask import pthread_sigmask
from lockrun.supervise import FORWARDED
from lockrun.timing import now

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Sequence


class Guardian:
    """A forked process that stops the command's group when lockrun cannot.

    docs/semantics.md G2: the command never runs without the lock. PR_SET_PDEATHSIG would cover the
    command alone, not its children, and only after a fork→prctl race (docs/design.md
    P18). The guardian instead leads a new process group that the command is then
    spawned into, so no moment exists when the command runs unguarded. It is forked before
    the wait, off the hand-over path, and then given copies of the lock's descriptors, so
    the lock stays held until the group is dead.

    It also keeps the lease's deadline (`expect`): a lockrun that is stopped (SIGSTOP, a
    debugger) or starved cannot renew, and its lease runs out on the server while the
    command works on. Unless lockrun confirms the lease again in time, the guardian sends
    TERM when lockrun itself would have, and KILL before the lease ends; it then tells
    lockrun so (`acted`). When lockrun dies first, it frees a lease that would otherwise
    run out only after a ttl (`orphan`), once the group is dead.

    Both can die at once (`killall -9 lockrun`, `pkill -9 -f 'lockrun .*nightly'`: the
    guardian is a fork with lockrun's name and command line), and neither could act. The
    kernel then does (`switch`): the command inherits the read end of a pipe whose write
    end only lockrun and the guardian hold, armed to raise SIGKILL for the command's whole
    group when the last writer closes, in any order and by any cause of death.
    """

    def __init__(
        self,
        abandon: Callable[[bytes], None] | None = None,
        inherited: Callable[[], None] | None = None,
    ) -> None:
        """Fork the guardian and make it the leader of a new process group.

        *abandon(orphan)* is how the guardian frees a lease that lockrun left behind dying
        (the backend's `abandon`; None where the lease ends with its holder anyway). As for
        any killed run, no --hold-at-least window is left (docs/semantics.md).
        *inherited()*, run in the guardian first, closes what it must not hold of
        lockrun's: the backend's connections, when it is forked after the run connected.
        """
        import socket  # noqa: PLC0415 - only runs without an inherited lock fd need it

        # Datagrams with boundaries: a message is never half of one.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The deadlines live in a page both share: lockrun writes them at every renewal
        # without ever waiting on a guardian that does not read (one stopped too would
        # fill a socket, and block the renewals that keep the lease); the guardian reads
        # the latest whenever it wakes.
        self._deadlines = _Deadlines()
        self.switch, self._armed = os.pipe2(os.O_CLOEXEC)  # read end: the command's
        # A handler that raises (lock._interruptible) must not run inside fork's at-fork
        # callbacks, where Python would print and drop the exception: hold the signals.
        saved = pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        # Every object made so far stays out of the collector's sight, in both processes: a
        # collection writes the header of each object it looks at, and so would copy every
        # page of the heap the two share (issue 32: 7 MiB more per waiting run).
        gc.freeze()
        try:
            self.pid = os.fork()
            if self.pid == 0:  # the forked guardian (coverage follows: patch = fork, _exit)
                os.close(self.switch)
                _guard(theirs, ours, self._deadlines, abandon, inherited)
            theirs.close()
            self._socket = ours
            self._acted = False
            self._orphan: bytes | None = None  # the lease it would free (`hold_fds`)
            os.setpgid(self.pid, self.pid)  # here too, so the group exists before the command
        finally:
            pthread_sigmask(signal.SIG_SETMASK, saved)
        _arm(self.switch, self.pid)

    def hold_fds(self, fds: Sequence[int], orphan: bytes | None = None) -> None:
        """Hand the guardian copies of *fds* to hold until it stands down.

        *orphan* names the lease for the backend's `abandon` should lockrun die; one it
        was told of already as a waiter's (`watch_lease`) is not told again: a message
        less on the hand-over's path.
        """
        import socket  # noqa: PLC0415 - loaded by __init__ already

        if fds:
            socket.send_fds(self._socket, [b"f"], list(fds))
        if orphan is not None and orphan != self._orphan:
            self._socket.sendall(b"o" + orphan)
            self._orphan = orphan

    def watch_lease(self, orphan: bytes) -> None:
        """Have the guardian free lease *orphan* should lockrun die (a waiter's, as it waits)."""
        self.hold_fds((), orphan)

    def forget(self) -> None:
        """Tell the guardian that lockrun releases the lease itself (before it does so).

        Told only where the release may leave a --hold-at-least window (the runner's
        choice): the guardian's own free (`abandon`) would cut it, should lockrun die
        before standing the guardian down.

        Nothing to say of a lease it was never told of (one that ends with its session):
        the holder's way to its release is the hand-over's.
        """
        if self._orphan is None:
            return
        self._orphan = None
        with contextlib.suppress(OSError):  # gone: it cannot abandon it either
            self._socket.sendall(b"r")
            os.kill(self.pid, signal.SIGCONT)  # one that was stopped must hear it in order

    def expect(self, term_at: float, kill_at: float, late: float) -> None:
        """Have the guardian TERM the group at *term_at* and KILL it at *kill_at* (`now`).

        Each call replaces the last; ``math.inf`` is never. Once it sent TERM, only an
        earlier KILL is taken. A guardian that wakes past *kill_at* (it was stopped too)
        sends TERM and gives *late* seconds before KILL, as for a lock known lost.
        """
        import socket  # noqa: PLC0415 - loaded by __init__ already

        earlier = self._deadlines.write(term_at, kill_at, late)
        if earlier:  # it sleeps until the old ones: wake it (rare: a stop begins)
            with contextlib.suppress(OSError):  # full, or gone with a SIGKILLed group
                self._socket.send(b"d", socket.MSG_DONTWAIT)

    def started(self) -> None:
        """Close our copy of the switch's read end: only the command's processes hold it now."""
        if self.switch >= 0:
            os.close(self.switch)
            self.switch = -1

    def left_behind(self) -> bool:
        """Return whether anything the ended command left is still in its group.

        Not who holds the switch: a process that closed every descriptor (closefrom(2), as
        daemons and set-uid programs do) holds none and runs on. The guardian leaves the
        group for ours (a parent may move a child that has not exec'd: setpgid(2)), so the
        group lives only while something of the command's does, and the guardian, alive,
        keeps its number from reuse. A zombie still counts: `members` looks closer.
        """
        with contextlib.suppress(OSError):  # gone already: it cannot be moved
            os.setpgid(self.pid, os.getpgrp())
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member we may not signal (sudo's) is one all the same
            pass
        return True

    def acted(self) -> bool:
        """Return whether the guardian stopped the command because the lease ran out."""
        with contextlib.suppress(OSError):
            while not self._acted and select.select([self._socket], [], [], 0)[0]:
                message = self._socket.recv(16)
                if not message:
                    break
                self._acted = message == b"t"
        return self._acted

    def stand_down(self) -> None:
        """Tell the guardian the command is done, disarm the switch, and reap the guardian.

        The group is empty by now (`_Watch._stop_stragglers`, or the KILL of a stopped
        run), so disarming it signals no one; the guardian is reaped after that, so its pid,
        the group's id, cannot be reused before.
        """
        with contextlib.suppress(OSError):  # it died with a SIGKILLed group
            self._socket.sendall(b"x")
            os.kill(self.pid, signal.SIGCONT)  # one that was stopped must run to hear it
        self._socket.close()
        self.started()
        os.close(self._armed)
        os.waitpid(self.pid, 0)


class OnDemand:
    """A run's guardian, forked when first needed: as late as it may be (docs/design.md A11).

    Each page lockrun writes after the fork is copied, and then held by both: forked as
    the backend begins to wait (`Request.waiting`) rather than before it connected and
    queued, a waiting etcd run cost 1 MiB less (issue #33). The command is never spawned
    before it (`now`, once the lock is held).
    """

    def __init__(self, make: Callable[[], Guardian]) -> None:
        """Fork nothing yet: *make* forks the guardian."""
        self._make = make
        self.guardian: Guardian | None = None

    def now(self) -> Guardian:
        """Return the guardian, forked now if it was not yet."""
        if self.guardian is None:
            self.guardian = self._make()
        return self.guardian

    def watch_lease(self, orphan: bytes) -> None:
        """As `Guardian.watch_lease`, forking it first: a backend begins to wait."""
        self.now().watch_lease(orphan)

    def stand_down(self) -> None:
        """As `Guardian.stand_down`, if it was ever forked."""
        if self.guardian is not None:
            self.guardian.stand_down()


class _Deadlines:
    """The guardian's deadlines in a shared page, behind a sequence number (a seqlock).

    One writer (lockrun's main thread), one reader (the guardian): the number is odd
    while a write is under way and is bumped again after it, and a read that saw it odd
    or changed is made again.
    """

    _SEQUENCE: Final = struct.Struct("=Q")
    _VALUES: Final = struct.Struct("=ddd")  # term_at, kill_at, late; after the sequence

    def __init__(self) -> None:
        """Map the page (shared with a child forked later) with no deadline in it."""
        import mmap  # noqa: PLC0415 - only runs with a guardian need it

        self._page = mmap.mmap(-1, self._SEQUENCE.size + self._VALUES.size)  # MAP_SHARED
        self._VALUES.pack_into(self._page, self._SEQUENCE.size, math.inf, math.inf, 0.0)

    def write(self, term_at: float, kill_at: float, late: float) -> bool:
        """Store the deadlines; return whether either came earlier than before."""
        (sequence,) = self._SEQUENCE.unpack_from(self._page, 0)
        old_term, old_kill, _ = self._VALUES.unpack_from(self._page, self._SEQUENCE.size)
        self._SEQUENCE.pack_into(self._page, 0, sequence + 1)
        self._VALUES.pack_into(self._page, self._SEQUENCE.size, term_at, kill_at, late)
        self._SEQUENCE.pack_into(self._page, 0, sequence + 2)
        return bool(term_at < old_term or kill_at < old_kill)

    def read(self) -> tuple[int, float, float, float]:
        """Return (sequence, term_at, kill_at, late) as last written whole."""
        while True:
            (before,) = self._SEQUENCE.unpack_from(self._page, 0)
            values = self._VALUES.unpack_from(self._page, self._SEQUENCE.size)
            (after,) = self._SEQUENCE.unpack_from(self._page, 0)
            if before == after and before % 2 == 0:
                return (before, *values)
            time.sleep(0)  # pragma: no cover - a write under way


def _arm(switch: int, group: int) -> None:
    """Have the kernel SIGKILL process *group* once no writer of *switch*'s pipe is left.

    The last close of a pipe's write end raises the read end's SIGIO (pipe(7), fcntl(2)
    O_ASYNC), sent to the owner F_SETOWN names (a negative number: a process group) as the
    signal F_SETSIG chooses; the kernel checks that lockrun's user may signal each member.
    The read end is the command's (`pass_fds`), so it lives while the command does, with
    the owner and signal set on it; data written to the pipe would raise it too, and no
    one ever writes.
    """
    fcntl.fcntl(switch, fcntl.F_SETOWN, -group)
    fcntl.fcntl(switch, fcntl.F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(switch, fcntl.F_SETFL, fcntl.fcntl(switch, fcntl.F_GETFL) | os.O_ASYNC)


def _guard(
    ours: socket.socket,
    theirs: socket.socket,
    deadlines: _Deadlines,
    abandon: Callable[[bytes], None] | None,
    inherited: Callable[[], None] | None,
) -> NoReturn:
    """In the guardian: hold what we are given until stood down; kill if lockrun vanishes.

    Also stop the group when a deadline of `Guardian.expect` passes unconfirmed, and free
    the lease lockrun left (`Guardian.hold_fds`'s *orphan*) once the group it guarded is dead.
    """
    try:
        theirs.close()
        if inherited is not None:
            with contextlib.suppress(Exception):  # a close that fails leaves the guardian be
                inherited()
        os.setpgid(0, 0)
        for signo in (*FORWARDED, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(signo, signal.SIG_IGN)
        pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        clock = _GuardClock(deadlines)
        heard = _Heard()
        while not heard.done:
            if select.select([ours], [], [], clock.wait())[0]:
                heard.read(ours)
            else:
                clock.act(ours)
        if heard.orphaned and abandon is not None and heard.orphan is not None:
            with contextlib.suppress(Exception):  # best effort: it lapses anyway
                abandon(heard.orphan)
    finally:
        os._exit(0)


class _GuardClock:
    """The guardian's deadlines (`Guardian.expect`): TERM, then KILL, unless moved on."""

    def __init__(self, deadlines: _Deadlines) -> None:
        self.deadlines = deadlines
        self.term_at = self.kill_at = math.inf
        self.late = 0.0
        self.seen = 0  # the sequence number of the deadlines taken
        self.stopping = False

    def wait(self) -> float | None:
        """Take the latest deadlines; return how long to sleep (None: until lockrun speaks)."""
        sequence, term, kill, self.late = self.deadlines.read()
        if sequence != self.seen:  # new ones: once stopping, only an earlier KILL counts
            self.seen = sequence
            self.kill_at = min(self.kill_at, kill) if self.stopping else kill
            self.term_at = self.term_at if self.stopping else term
        due = min(self.kill_at, math.inf if self.stopping else self.term_at)
        return None if due == math.inf else max(0.0, due - now())

    def act(self, lockrun: socket.socket) -> None:
        """Send what is due, telling *lockrun* (unless the deadlines moved while we slept)."""
        current = now()
        if self.deadlines.read()[0] != self.seen:
            return
        if not self.stopping and current >= self.term_at:
            self.stopping = _tell(lockrun)
            # Our pid, not 0: at the command's end we leave the group (`left_behind`).
            os.killpg(os.getpid(), signal.SIGTERM)  # we ignore it ourselves
            os.killpg(os.getpid(), signal.SIGCONT)  # a stopped command must run to take it
            if current >= self.kill_at:
                self.kill_at = max(self.kill_at, current + self.late)
        elif current >= self.kill_at:
            self.stopping = _tell(lockrun)
            kill_the_others()
            self.kill_at = math.inf


class _Heard:
    """What lockrun told the guardian: descriptors to hold, the lease to free, the end."""

    def __init__(self) -> None:
        self.kept: list[int] = []
        self.orphan: bytes | None = None  # the lease to free should lockrun die
        self.done = self.orphaned = False

    def read(self, lockrun: socket.socket) -> None:
        """Take one message; at EOF (lockrun is gone), take the group down first."""
        import socket  # noqa: PLC0415 - already loaded by Guardian

        message, fds, _, _ = socket.recv_fds(lockrun, 65536, 16)
        self.kept += fds
        kind = message[:1]
        if not message:  # lockrun is gone: the group goes, then we and the lock do
            kill_the_others()
            self.done = self.orphaned = True
        elif kind == b"x":
            self.done = True
        elif kind == b"o":  # a lease to free should lockrun die
            self.orphan = message[1:]
        elif kind == b"r":  # lockrun releases it itself
            self.orphan = None


def _tell(lockrun: socket.socket) -> bool:
    """Tell *lockrun* that we stopped its command; return True (we are stopping)."""
    with contextlib.suppress(OSError):
        lockrun.send(b"t")
    return True


__all__ = ["Guardian", "OnDemand"]
