"""Timed flock(2) waits: the command line's under a timer, the Python API's without (docs/api.md).

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

import fcntl
import os
import select
import signal
import time
from typing import Final

from lockrun.backends import inotify
from lockrun.timing import now

# fsnotify reports a close before the kernel drops its flock (fs/file_table.c, __fput):
# after a close, look again soon, then less and less often.
_SOON: Final = 0.001
SLOW_WAKE: Final = 1.0  # longest pause between looks when no wake-up can be heard
_CLAIMED: Final[list[bool]] = []  # [True] in lockrun's own command line


def claim_signals() -> None:
    """Say this process is lockrun's command line: its waits may use SIGALRM and ITIMER_REAL."""
    _CLAIMED[:] = [True]


def signals_claimed() -> bool:
    """Whether `claim_signals` was called: not in an application using the Python API."""
    return bool(_CLAIMED)


def try_flock(fd: int, mode: int = fcntl.LOCK_EX) -> bool:
    """Take a flock of *mode* on *fd* if it is free (or already ours); never block."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class _Expired(Exception):
    pass


def _raise_expired(_signum: int, _frame: object) -> None:
    raise _Expired


def wait_flock(fd: int, deadline: float | None, mode: int = fcntl.LOCK_EX) -> bool:
    """Block in flock(2) until *fd* is locked in *mode* (True) or *deadline* passes (False)."""
    if try_flock(fd, mode):
        return True
    if deadline is None:
        fcntl.flock(fd, mode)
        return True
    timeout = deadline - now()
    if timeout <= 0:
        return False
    if not signals_claimed():  # the Python API: SIGALRM is the application's (#29)
        return _wait_for_closes(fd, deadline, mode)
    # A timed flock: an interval timer whose handler raises interrupts the blocking call
    # (PEP 475 retries EINTR only when the handler returns) [docs/design.md A1, verified].
    try:
        previous = signal.signal(signal.SIGALRM, _raise_expired)
    except ValueError:  # not the main thread: no signals here
        return _wait_for_closes(fd, deadline, mode)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            fcntl.flock(fd, mode)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Expired:
        pass
    finally:
        signal.signal(signal.SIGALRM, previous)
    return try_flock(fd, mode)  # re-locking our own lock succeeds: covers a grant racing the timer


def _wait_for_closes(fd: int, deadline: float, mode: int) -> bool:
    """Lock *fd* in *mode* (True) unless *deadline* passes first (False); no signal, no timer."""
    bell = inotify.watch(fd, inotify.CLOSE)  # before the try: a close in between rings it
    pause = _SOON
    try:
        while not try_flock(fd, mode):
            left = deadline - now()
            if left <= 0:
                return False
            pause = _SOON if _rung(bell, min(pause, left)) else min(pause * 2, SLOW_WAKE)
        return True
    finally:
        if bell is not None:
            os.close(bell)


def _rung(bell: int | None, timeout: float) -> bool:
    """Wait up to *timeout* seconds for *bell*; return whether it rang (and drain it)."""
    if bell is None:  # no inotify, or no instance left: the back-off alone
        time.sleep(timeout)
        return False
    poll = select.poll()
    poll.register(bell, select.POLLIN)
    if not poll.poll(timeout * 1000):
        return False
    inotify.drain(bell)
    return True
