"""inotify(7) through ctypes, for the file backend's bells: loaded on first use.

Two bells ring on a lock file: a held lease's take-over bell (a taker touches the file,
docs/design.md A1) and the Python API's flock wait (someone closed the file, `flockwait`).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

ATTRIB: Final = 0x004  # times, mode or link count changed (a taker's touch)
CLOSE: Final = 0x08 | 0x10  # IN_CLOSE_WRITE | IN_CLOSE_NOWRITE
DELETE_SELF: Final = 0x400
MOVE_SELF: Final = 0x800
_CALLS: list[Callable[..., int]] = []  # inotify_init1, inotify_add_watch; [] not loaded yet


def load() -> bool:
    """Find inotify in the C library (ctypes costs ~1.5 ms of start-up: loaded when needed)."""
    if not _CALLS:
        try:
            import ctypes  # noqa: PLC0415 - only held leases and waits need it

            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (ImportError, OSError, AttributeError):  # not Linux: the refresh cadence only
            _CALLS.append(lambda *_: -1)
            return False
        init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
        add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        add.restype = ctypes.c_int
        _CALLS.extend((init, add))
    return len(_CALLS) == 2  # noqa: PLR2004


def watch(fd: int, mask: int) -> int | None:
    """Return an inotify descriptor that turns readable on the *mask* events of *fd*'s file.

    None where there is no inotify, or no instance left (fs.inotify.max_user_instances).
    """
    if not load():
        return None
    init, add = _CALLS
    bell = init(os.O_NONBLOCK | os.O_CLOEXEC)
    if bell < 0:
        return None
    # The magic link names the open file itself, even one renamed or unlinked meanwhile.
    if add(bell, f"/proc/self/fd/{fd}".encode(), mask) < 0:
        os.close(bell)
        return None
    return bell


def drain(bell: int) -> None:
    """Read what a bell has to say, so that it rings again for the next event only."""
    with contextlib.suppress(OSError):  # EAGAIN once empty
        while os.read(bell, 4096):
            pass
