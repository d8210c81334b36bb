"""--take-over on a lock file: the taker's request and the holders' bell (docs/design.md A1).

A request is an OFD write lock (fcntl(2), F_OFD_SETLK) on byte _REQUESTS + (uid <<
_PID_BITS) + pid of the lock file, far past anything written there. A write lock needs a
descriptor open for writing, so only a process that could open the lock file for writing,
and so take the lock, can ask; one that may only read it, whatever it execs later (a
set-uid program), cannot (docs/security.md). flock(2) locks never meet these. The holders'
bell is an inotify watch on their lock file, which the taker touches.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from typing import Final

from lockrun.backends import inotify, user_name
from lockrun.backends.file.records import stranger

_REQUESTS: Final = 1 << 62
_PID_BITS: Final = 22  # PID_MAX_LIMIT: pids stay below 2**22; uids fit in the 40 bits above
_FLOCK: Final = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid


def bell(fd: int) -> int | None:
    """Return an inotify descriptor that turns readable when the file open as *fd* is touched.

    Touched: its times or mode changed (a taker's utime), or it was unlinked or renamed. None
    where there is no inotify, or no instance left (fs.inotify.max_user_instances).
    """
    return inotify.watch(fd, inotify.ATTRIB | inotify.DELETE_SELF | inotify.MOVE_SELF)


def ring(fd: int) -> None:
    """Touch the lock file open as *fd*: its holders' bells ring (a refresh would see it too)."""
    with contextlib.suppress(OSError):
        os.utime(fd)


def taken_by(taker: str) -> str:
    """Say who took the lock over, as `TakenOver`'s message."""
    return f"taken over by {taker}"


def _request_lock(kind: int, start: int, length: int = 1) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0)


def request_byte(uid: int, pid: int) -> int:
    """Return the byte whose write lock is user *uid*'s process *pid*'s request."""
    return _REQUESTS + ((uid & 0xFFFF_FFFF) << _PID_BITS) + pid % (1 << _PID_BITS)


def ask_to_stop(fd: int) -> bool:
    """Ask the holders of the lock file open for writing as *fd* to give way (docs/design.md A1).

    The request lasts until `unask`, or until the last descriptor of this open file is
    closed: it ends with the taker, SIGKILL included. The byte says who asks (the only
    record of it), and only a writer of the lock file can lock it. False if a lock of
    another process's covers the byte: a reader's read lock may (docs/security.md).
    """
    start = request_byte(os.geteuid(), os.getpid())
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request_lock(fcntl.F_WRLCK, start))
    except OSError:  # EAGAIN; EINVAL where there are no OFD locks
        return False
    return True


def unask(fd: int) -> None:
    """Withdraw our request on the lock file open as *fd*, if any."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request_lock(fcntl.F_UNLCK, _REQUESTS, 0))


def taker(fd: int) -> str | None:
    """Say who asks the holders of the lock file open as *fd* to give way; None: nobody does.

    Only write locks count: a read lock needs no more than read access to the file. And
    only in a file that no user but us, root and our groups could write (`stranger`): who
    else may write it may take the lock, not stop us. The user and pid are what the
    taker's byte says; no process is looked up (docs/security.md).
    """
    try:
        found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _request_lock(fcntl.F_RDLCK, _REQUESTS, 0))
        who = asker(struct.unpack(_FLOCK, found))
        if who is not None and stranger(os.fstat(fd)) is not None:
            return None
    except OSError:  # EINVAL: no OFD locks here (Linux < 3.15, another system)
        return None
    return who


def asker(found: tuple[int, ...]) -> str | None:
    """Decode the lock F_OFD_GETLK found (a `struct flock`) into who asks; None if no request."""
    kind, _, start, length, _ = found
    if kind != fcntl.F_WRLCK or start < _REQUESTS or length != 1:
        return None  # none; or a lock of someone else's over the file, not a request
    uid, pid = divmod(start - _REQUESTS, 1 << _PID_BITS)
    return f"{user_name(uid)}@{os.uname().nodename} pid {pid}"
