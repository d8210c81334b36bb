"""A held slot of a ``file:`` lock: its locked file, and the bell a taker rings."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from lockrun.backends import inotify
from lockrun.backends.directories import failure
from lockrun.backends.file.records import overwrite, window_marker
from lockrun.backends.file.takeover import bell, ring, taken_by, taker
from lockrun.errors import LeaseLost, TakenOver
from lockrun.timing import now

if TYPE_CHECKING:
    import socket

    from lockrun.backends.file.directory import Held


class FileLease:
    """A held slot: its locked file (and, for a semaphore, a wake-up socket).

    A shared (reader) lease holds NAME.lock with LOCK_SH and writes nothing into it.
    """

    ttl: float | None = None  # the slot lives as long as some process has the fd
    sessions: tuple[int, ...] = ()
    orphan: bytes | None = None  # the lock ends with its last descriptor

    def __init__(
        self,
        slot: int,
        fence: int | None,
        held: Held,
        wake: socket.socket | None,
    ) -> None:
        """Wrap the slot file *held*, locked, as slot *slot* with *fence*.

        *fence* is None for a shared lease, which has none (docs/semantics.md).
        """
        self.slot, self.fence, self.path = slot, fence, held.path
        self.confirmed = now()  # no lease: for the record only
        self._fd: int | None = held.fd
        self._identity = held.identity
        self._counter = held.counter  # the bytes that stay: the counter line
        self._record = held.record  # the holder's line after it, kept for a window's marker
        self._written = held.written
        self._wake = wake
        self._bell: int | None = None
        self._armed = False

    @property
    def fds(self) -> tuple[int, ...]:
        """Return the lock fd and wake-up socket, which keep the slot while a command has them."""
        fds = () if self._fd is None else (self._fd,)
        return fds + (() if self._wake is None else (self._wake.fileno(),))

    @property
    def bells(self) -> tuple[int, ...]:
        """Return an inotify fd on the lock file: a taker touches it (docs/design.md A1).

        Made on first use, so a block that never asks pays nothing. A request made before
        the watch existed rings it at once: we touch the file ourselves.
        """
        if not self._armed and self._fd is not None:
            self._armed = True
            self._bell = bell(self._fd)
            if self._bell is not None and taker(self._fd) is not None:
                ring(self._fd)
        return () if self._bell is None else (self._bell,)

    def refresh(self) -> None:
        """Raise `LeaseLost` if the lock file's path no longer names the file we locked.

        By path, not in the directory we opened: a directory deleted or replaced (a tmpfs
        cleaned up, a renamed release) sends every newcomer to another file, too. Then
        raise `TakenOver` if another acquirer asks for the lock with --take-over.
        """
        if self._bell is not None:
            inotify.drain(self._bell)
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            info = None
        except OSError as err:
            raise failure(f"lock file {self.path}", err) from err
        if info is None or (info.st_dev, info.st_ino) != self._identity:
            msg = f"lock file {self.path} was deleted or replaced; another process can lock it now"
            raise LeaseLost(msg)
        if self._fd is not None and (asker := taker(self._fd)):
            raise TakenOver(taken_by(asker))

    def release(self, hold: float = 0.0) -> bool:
        """Clear the holder record and unlock; the file and its fence counter stay.

        With *hold*, leave the record with the window's end instead (--hold-at-least).
        """
        if self._fd is not None:
            if self.fence is not None and self._written:  # a shared lease wrote nothing
                with contextlib.suppress(OSError):
                    if hold > 0 and self._record:
                        overwrite(self._fd, window_marker(self._record, time.time() + hold))
                    else:
                        # Blanked, not cut: the next grant writes over it in place
                        # (FileBackend._grant; readers find no record in blanks).
                        os.pwrite(
                            self._fd, b" " * (len(self._record) - self._counter), self._counter
                        )
            os.close(self._fd)  # unlocks unless a command still holds a duplicate
            self._fd = None
        if self._wake is not None:  # after the unlock, so the head finds the slot free
            self._wake.close()
            self._wake = None
        if self._bell is not None:
            os.close(self._bell)
            self._bell = None
        return True
