"""A lock directory held open, and its lock files opened safely (docs/security.md)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.backends import MAX_RECORD
from lockrun.backends.directories import describe_uid, failure, open_directory
from lockrun.backends.file.records import counter_line, split, stranger
from lockrun.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

# O_NONBLOCK: opening a FIFO planted as a lock file must not hang (its reader never comes);
# O_NOFOLLOW: nor may a planted symlink take us elsewhere. Only regular files are used.
_OPEN: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_PATHS: Final = 1024  # file names whose paths a directory remembers
_EFFECTIVE: Final = os.access in os.supports_effective_ids  # access(2) as the opens see it


class Held(NamedTuple):
    """A slot file of ours, opened: what a lease keeps of it once it is locked."""

    path: str
    fd: int
    identity: tuple[int, int]  # (st_dev, st_ino)
    counter: int = 0  # the length of its counter line, once the grant has written it
    record: bytes = b""  # what the grant wrote: the counter line and the holder's record
    written: bool = True  # False: a file with other names, which lockrun never writes


@contextlib.contextmanager
def closed_on_error(fd: int) -> Iterator[None]:
    """Close *fd* if the block raises (Ctrl-C included), so no lock is left behind."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


class LockDirectory:
    """The directory of a ``file:`` URI: opened (and made) on first use, checked on each."""

    def __init__(
        self,
        directory: str,
        *,
        private: bool,
        make_below: str,
        note: Callable[[str], None] | None = None,
    ) -> None:
        """Use *directory*, making what is missing below *make_below* on first use.

        *private*: the default directory, which must be ours and is kept 0700. *note* gets
        what `-v` shows: records not believed.
        """
        self.directory = directory
        self._paths: dict[str, str] = {}
        self.private = private
        self.make_below = make_below
        self._note = note
        self._noted: set[str] = set()  # lock files whose records were noted as not believed
        self._fd: int | None = None
        self.identity = (0, 0)  # the directory's (st_dev, st_ino) while it is open
        self._writable = False  # _fd passed _check_writable

    def opened(self, *, make: bool = True) -> int:
        """Return the lock directory, opened (and, with *make*, made) on first use.

        A backend serves many acquisitions, so each looks whether the path still names
        the directory held open: one deleted (a tmpfs cleaned up) or replaced since then
        would have us lock files that nobody else opens. Then it is opened again.
        """
        if self._fd is not None and not self._still_named():
            self.close()
        if self._fd is None:
            below = self.make_below if make else None
            fd = open_directory(self.directory, make_below=below, private=self.private)
            info = os.fstat(fd)
            self._fd, self.identity, self._writable = fd, (info.st_dev, info.st_ino), False
        if make and not self._writable:
            self._check_writable(self._fd)
            self._writable = True
        return self._fd

    @property
    def fd(self) -> int:
        """The lock directory as `opened` last found it, at the start of this call."""
        return self.opened() if self._fd is None else self._fd

    def _still_named(self) -> bool:
        """Whether the directory's path still leads to the directory we hold open."""
        try:
            info = os.stat(self.directory, follow_symlinks=False)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.identity

    def _check_writable(self, fd: int) -> None:
        """Refuse, with a clear line, a directory we could lock nothing in."""
        where = f"/proc/self/fd/{fd}"  # the directory we opened, not whatever the path is now
        if os.access(
            where, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids
        ):
            return
        if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
            msg = f"lock directory {self.directory} is on a read-only file system"
            raise BackendUnavailable(msg)
        msg = f"lock directory {self.directory} is not writable"
        raise ConfigError(msg)

    def path(self, filename: str) -> str:
        """Return the path of the lock file *filename*, for messages and records."""
        if (path := self._paths.get(filename)) is None:  # every grant names its file
            path = self._paths[filename] = os.path.join(self.directory, filename)
            if len(self._paths) > _PATHS:
                self._paths.clear()
        return path

    def open(self, filename: str) -> Held:
        """Open (or make) a lock file: a regular file, nothing else; say if it has other names."""
        try:
            try:
                fd = self._open_or_make(filename)
            except FileNotFoundError:
                # Making a plain name fails so only in a directory deleted since
                # opened looked: open (or make) it again, once.
                self.close()
                fd = self._open_or_make(filename)
        except OSError as err:
            raise self._failure(filename, err) from err
        with closed_on_error(fd):
            info = self._check(fd, filename)
        path, written = self.path(filename), info.st_nlink == 1
        if not written and self._note is not None and path not in self._noted:
            self._noted.add(path)
            self._note(
                f"lock file {path} has {info.st_nlink} names (hard links): locked, never written"
            )
        return Held(path, fd, (info.st_dev, info.st_ino), written=written)

    def _failure(self, filename: str, err: OSError) -> ConfigError | BackendUnavailable:
        """Translate *err* of opening *filename*: a symlink there is named with its maker."""
        path = self.path(filename)
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink (docs/security.md)
            try:
                maker = os.stat(filename, dir_fd=self.fd, follow_symlinks=False).st_uid
            except OSError:
                maker = None
            who = "" if maker is None else f", made by {describe_uid(maker)}"
            return ConfigError(f"lock file {path} is a symlink{who}; lockrun never follows one")
        return failure(f"lock file {path}", err)

    def _open_or_make(self, filename: str) -> int:
        """Open the lock file *filename* for reading and writing, making it if it is missing.

        Never O_CREAT without O_EXCL: with fs.protected_regular (systemd's default) that open
        fails (EACCES) on a file another user made in a sticky directory, which would let
        any co-user keep our jobs out of a shared 1777 directory (78) by making NAME.lock
        first. Such a file is locked, never believed (docs/security.md).
        """
        flags = os.O_RDWR | _OPEN
        with contextlib.suppress(FileNotFoundError):
            return os.open(filename, flags, dir_fd=self.fd)
        try:
            mode = 0o600 if self.private else 0o666
            return os.open(filename, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=self.fd)
        except FileExistsError:  # made by another process since: open that
            return os.open(filename, flags, dir_fd=self.fd)

    def _check(self, fd: int, filename: str) -> os.stat_result:
        """Raise `ConfigError` unless the opened *fd* is a regular file.

        One with other names (hard links) may be another file of anyone's: it is locked,
        never written (`Held.written`). Refusing it let any user who made NAME.lock a
        second name of a file of theirs keep every other user out (docs/security.md).
        """
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file (a FIFO, a device or a socket?)"
            msg = f"lock file {self.path(filename)} {problem}; remove it"
            raise ConfigError(msg)
        return info

    def read(self, filename: str) -> bytes:
        """Return the start of a lock file of ours that may be missing (then b"").

        Refuses (78) what `open` refuses: a planted symlink, FIFO or device.
        """
        try:
            fd = os.open(filename, os.O_RDONLY | _OPEN, dir_fd=self.fd)
        except FileNotFoundError:
            return b""
        except OSError as err:
            raise self._failure(filename, err) from err
        try:
            self._check(fd, filename)
            return os.pread(fd, 32, 0)
        finally:
            os.close(fd)

    def exists(self, filename: str) -> bool:
        """Say whether the directory has an entry *filename* (a missing one costs no error)."""
        return os.access(filename, os.F_OK, dir_fd=self.fd, effective_ids=_EFFECTIVE)

    def peek(self, filename: str) -> tuple[tuple[int, int] | None, bytes]:
        """Return the identity and the content of a lock file, if it is a regular file.

        Without its record if another user could have written it (`stranger`).
        """
        try:
            fd = os.open(filename, os.O_RDONLY | _OPEN, dir_fd=self.fd)
        except OSError:
            return None, b""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # open reports what is wrong with it
                return None, b""
            content = os.pread(fd, MAX_RECORD + 1, 0)
        except OSError:  # EIO, or a file that is no longer what it was
            return None, b""
        finally:
            os.close(fd)
        if stranger(info) is not None:  # its record is not believed; its counter is
            content = counter_line(content)
        return (info.st_dev, info.st_ino), content

    def believed(self, held: Held, content: bytes) -> bytes:
        """Return what of *content*, read from *held*, may be believed; note what may not.

        A record that another user could have written (docs/security.md) is dropped: only
        the counter line stays, which no decision but the fence's rests on.
        """
        if not split(content)[1].strip():  # no record: nothing to believe or not
            return content
        try:
            who = stranger(os.fstat(held.fd))
        except OSError:
            who = "a user lockrun cannot tell"
        if who is None:
            return content
        if self._note is not None and held.path not in self._noted:
            self._noted.add(held.path)
            self._note(
                f"the record in lock file {held.path} is not believed: {who} could have "
                "written it (a --hold-at-least window there holds nothing)"
            )
        return counter_line(content)

    def close(self) -> None:
        """Close the directory."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
