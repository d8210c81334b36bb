"""Timed flock(2) waits that leave signals and timers alone: the Python API's (docs/api.md).

The command line owns its process: it waits in flock(2) under an interval timer whose SIGALRM
handler raises (docs/design.md A1), and says so with `claim_signals`. A library must not:
ITIMER_REAL and SIGALRM's handler are the application's, and a wait that borrowed them
cancelled the application's timer (#29). Everywhere else a timed wait tries LOCK_NB each
time someone closes the lock file, which inotify(7) reports: the kernel drops a flock with
the last close of its open file, a killed holder's too. A flock let go without a close
(``flock -u``) is found by a back-off of up to a second. Such a waiter keeps no place in the
kernel's queue: it may pass waiters that block in flock(2).
"""

from __future__ import annotations

import os
import select
import time
from typing import Final

from lockrun.timing import now

_IN_CLOSE: Final = 0x08 | 0x10  # inotify(7): IN_CLOSE_WRITE | IN_CLOSE_NOWRITE
# fsnotify reports a close before the kernel drops its flock (fs/file_table.c, __fput):
# after a close, look again soon, then less and less often.
_SOON: Final = 0.001
_CLAIMED: Final[list[bool]] = []  # [True] in lockrun's own command line


def claim_signals() -> None:
    """Say this process is lockrun's command line: its waits may use SIGALRM and ITIMER_REAL."""
    _CLAIMED[:] = [True]


def signals_claimed() -> bool:
    """Whether `claim_signals` was called: not in an application using the Python API."""
    return bool(_CLAIMED)


def wait_flock(fd: int, deadline: float, mode: int) -> bool:
    """Lock *fd* in *mode* (True) unless *deadline* passes first (False); no signal, no timer."""
    from lockrun.backends.file import _SLOW_WAKE, try_flock  # noqa: PLC0415 - file.py uses us

    bell = _closes(fd)  # before the try: a close in between rings it
    pause = _SOON
    try:
        while not try_flock(fd, mode):
            left = deadline - now()
            if left <= 0:
                return False
            pause = _SOON if _rung(bell, min(pause, left)) else min(pause * 2, _SLOW_WAKE)
        return True
    finally:
        if bell is not None:
            os.close(bell)


def _closes(fd: int) -> int | None:
    """Return an inotify descriptor that turns readable when anyone closes *fd*'s file.

    None where there is no inotify, or no instance left (fs.inotify.max_user_instances):
    then the back-off alone.
    """
    from lockrun.backends import file  # noqa: PLC0415 - file.py imports this module

    if not file._load_inotify():  # noqa: SLF001 - its loader of the C library, shared
        return None
    init, add = file._INOTIFY  # noqa: SLF001
    bell = init(os.O_NONBLOCK | os.O_CLOEXEC)
    if bell < 0:
        return None
    # The magic link names the open file itself, even one renamed or unlinked meanwhile.
    if add(bell, f"/proc/self/fd/{fd}".encode(), _IN_CLOSE) < 0:
        os.close(bell)
        return None
    return bell


def _rung(bell: int | None, timeout: float) -> bool:
    """Wait up to *timeout* seconds for *bell*; return whether it rang (and drain it)."""
    if bell is None:
        time.sleep(timeout)
        return False
    poll = select.poll()
    poll.register(bell, select.POLLIN)
    if not poll.poll(timeout * 1000):
        return False
    from lockrun.backends.file import _drain  # noqa: PLC0415 - file.py imports this module

    _drain(bell)
    return True
