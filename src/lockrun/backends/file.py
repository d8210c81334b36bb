"""flock(2) on files in a directory: the embedded default, with no server.

Slot 0 of a name is ``<dir>/<name>.lock``, the very file ``flock(1)`` would lock, so a
mutex excludes flock(1) users and the other way round. Lock files are never unlinked:
unlink-on-release lets two processes lock two inodes of one path (portalocker #115,
tox-dev/filelock #27). A semaphore queues its waiters on ``<name>.gate``, which the kernel
grants in arrival order; only the gate's holder sweeps the slot files ``<name>~<i>.lock``
and sleeps until a slot holder's abstract socket hangs up (docs/design.md A2).

A slot file's first line is the fence counter, which stays when the holder leaves; a
holder's JSON record follows it while the slot is held. So a grant reads and writes only
the file it locked: one ``pread`` and one ``pwrite`` (docs/design.md A1).

The modes (docs/design.md A1): --shared is flock(2)'s LOCK_SH on NAME.lock, with every
lockrun waiter queued on NAME.gate so a later reader cannot pass a waiting writer; a
--hold-at-least window is the record left in NAME.lock with an ``until``; a --take-over
request is a write lock on one byte of NAME.lock far past its end, which only a descriptor
open for writing can take, and the holders' bell an inotify watch on their lock file, which
the taker touches.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import signal
import stat
import struct
import time
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.backends import (
    MAX_RECORD,
    Holder,
    LockState,
    Request,
    _user,
    describe_pid,
    flockwait,
    next_fence,
    read_json,
    slots_mismatch,
)
from lockrun.backends.directories import (
    default_directory,
    describe_uid,
    failure,
    open_directory,
)
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.errors import BackendUnavailable, ConfigError, LeaseLost, TakenOver
from lockrun.names import escape, unescape
from lockrun.timing import now

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Iterator

    from lockrun.uri import LockURI

DEFAULT_NAMESPACE: Final = "default"
_MAX_BASE: Final = 200  # leaves room for "~NNN.lock" within NAME_MAX (255)
_LOCK_FILE: Final = r"(?P<base>[^.~]+(?:\.[^.~]+)?)(?:~(?P<slot>\d+))?\.lock"  # status only
_SLOW_WAKE: Final = 1.0  # longest pause when a slot's holder has no wake-up socket
# O_NONBLOCK: opening a FIFO planted as a lock file must not hang (its reader never comes);
# O_NOFOLLOW: nor may a planted symlink take us elsewhere. Only regular files are used.
_OPEN: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SINCE_AND_SLOT: Final = ', "since": null, "slot": null'  # what _record_line fills in
_UNTIL: Final = b'"until": '  # a --hold-at-least window's end, in a record left behind
# A window read back that ends further away than any --hold-at-least could make it was
# never written by lockrun (a forged record, a clock stepped back by a year): no window.
_LONGEST_WINDOW: Final = MAX_WAIT + 86400.0
_WINDOW_NAP: Final = 1.0  # a window's wait looks at the wall clock again this often
# A --take-over request: an OFD write lock (fcntl(2), F_OFD_SETLK) on byte _REQUESTS + (uid <<
# _PID_BITS) + pid of the lock file, far past anything written there. A write lock needs a
# descriptor open for writing, so only a process that could open the lock file for writing,
# and so take the lock, can ask; one that may only read it, whatever it execs later (a
# set-uid program), cannot (docs/security.md). flock(2) locks never meet these.
_REQUESTS: Final = 1 << 62
_PID_BITS: Final = 22  # PID_MAX_LIMIT: pids stay below 2**22; uids fit in the 40 bits above
_FLOCK: Final = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,  # noqa: ARG001 - local locks are no leases
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> FileBackend:
    """Check the lock directory of a ``file:`` URI; it is opened (and made) on first use."""
    if uri.netloc not in {"", "localhost"}:
        msg = f"file: URIs name a local directory, not host {uri.netloc!r}"
        raise ConfigError(msg)
    if uri.query:
        msg = f"{uri.redacted}: file: URIs take no options (write a ? in a directory as %3F)"
        raise ConfigError(msg)
    if uri.path:
        if not uri.path.startswith("/"):
            msg = (
                f"{uri.redacted}: the lock directory must be an absolute path, as in "
                "file:///var/lock/myapp (this one would depend on the current directory)"
            )
            raise ConfigError(msg)
        return FileBackend(uri.path, private=False, make_below="/", warn=warn, note=note)
    default = default_directory()
    return FileBackend(default.path, private=True, make_below=default.parent, warn=warn, note=note)


def _base(namespace: str, name: str) -> str:
    """Return the file-name stem of a lock: ``name``, or ``namespace.name`` outside default."""
    key = escape(name) if namespace == DEFAULT_NAMESPACE else f"{escape(namespace)}.{escape(name)}"
    if len(key) <= _MAX_BASE:
        return key
    digest = _sha256(f"{namespace}\0{name}")[:32]
    return f"{key[:150]}%%{digest}"  # "%%" never comes out of escape(): no collisions


def _sha256(text: str) -> str:
    import hashlib  # noqa: PLC0415 - only long names and semaphores pay for OpenSSL's load

    return hashlib.sha256(text.encode()).hexdigest()


def _slot_file(base: str, slot: int) -> str:
    return f"{base}.lock" if slot == 0 else f"{base}~{slot}.lock"


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
    if not flockwait.signals_claimed():  # the Python API: SIGALRM is the application's (#29)
        return flockwait.wait_flock(fd, deadline, mode)
    # A timed flock: an interval timer whose handler raises interrupts the blocking call
    # (PEP 475 retries EINTR only when the handler returns) [docs/design.md A1, verified].
    try:
        previous = signal.signal(signal.SIGALRM, _raise_expired)
    except ValueError:  # not the main thread: no signals here
        return flockwait.wait_flock(fd, deadline, mode)
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


# -- the take-over bell: inotify(7) on the held lock file -----------------------------------

_IN_ATTRIB: Final = 0x004  # inotify(7): times, mode or link count changed (a taker's touch)
_IN_DELETE_SELF: Final = 0x400
_IN_MOVE_SELF: Final = 0x800
_INOTIFY: list[Callable[..., int]] = []  # inotify_init1, inotify_add_watch; [] not loaded yet


def _load_inotify() -> bool:
    """Find inotify in the C library (ctypes costs ~1.5 ms of start-up: loaded when needed)."""
    if not _INOTIFY:
        try:
            import ctypes  # noqa: PLC0415 - only held leases need it

            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (ImportError, OSError, AttributeError):  # not Linux: the refresh cadence only
            _INOTIFY.append(lambda *_: -1)
            return False
        init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
        add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        add.restype = ctypes.c_int
        _INOTIFY.extend((init, add))
    return len(_INOTIFY) == 2  # noqa: PLR2004


def _watch(fd: int) -> int | None:
    """Return an inotify descriptor that turns readable when the file open as *fd* is touched.

    Touched: its times or mode changed (a taker's utime), or it was unlinked or renamed. None
    where there is no inotify, or no instance left (fs.inotify.max_user_instances).
    """
    if not _load_inotify():
        return None
    init, add = _INOTIFY
    bell = init(os.O_NONBLOCK | os.O_CLOEXEC)
    if bell < 0:
        return None
    # The magic link names the open file itself, even one renamed or unlinked meanwhile.
    mask = _IN_ATTRIB | _IN_DELETE_SELF | _IN_MOVE_SELF
    if add(bell, f"/proc/self/fd/{fd}".encode(), mask) < 0:
        os.close(bell)
        return None
    return bell


def _drain(bell: int) -> None:
    """Read what a bell has to say, so that it rings again for the next event only."""
    with contextlib.suppress(OSError):  # EAGAIN once empty
        while os.read(bell, 4096):
            pass


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
        held: _Held,
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
            self._bell = _watch(self._fd)
            if self._bell is not None and _taker(self._fd) is not None:
                with contextlib.suppress(OSError):
                    os.utime(self._fd)
        return () if self._bell is None else (self._bell,)

    def refresh(self) -> None:
        """Raise `LeaseLost` if the lock file's path no longer names the file we locked.

        By path, not in the directory we opened: a directory deleted or replaced (a tmpfs
        cleaned up, a renamed release) sends every newcomer to another file, too. Then
        raise `TakenOver` if another acquirer asks for the lock with --take-over.
        """
        if self._bell is not None:
            _drain(self._bell)
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            info = None
        except OSError as err:
            raise failure(f"lock file {self.path}", err) from err
        if info is None or (info.st_dev, info.st_ino) != self._identity:
            msg = f"lock file {self.path} was deleted or replaced; another process can lock it now"
            raise LeaseLost(msg)
        if self._fd is not None and (taker := _taker(self._fd)):
            raise TakenOver(_taken_by(taker))

    def release(self, hold: float = 0.0) -> bool:
        """Clear the holder record and unlock; the file and its fence counter stay.

        With *hold*, leave the record with the window's end instead (--hold-at-least).
        """
        if self._fd is not None:
            if self.fence is not None and self._written:  # a shared lease wrote nothing
                with contextlib.suppress(OSError):
                    if hold > 0 and self._record:
                        _overwrite(self._fd, _window_marker(self._record, time.time() + hold))
                    else:
                        os.ftruncate(self._fd, self._counter)
            os.close(self._fd)  # unlocks unless a command still holds a duplicate
            self._fd = None
        if self._wake is not None:  # after the unlock, so the head finds the slot free
            self._wake.close()
            self._wake = None
        if self._bell is not None:
            os.close(self._bell)
            self._bell = None
        return True


def _taken_by(taker: str) -> str:
    return f"taken over by {taker}"


def _window_marker(data: bytes, until: float) -> bytes:
    """Return the slot file's *data* (counter line and record) with the record ending *until*."""
    counter, _, line = data.partition(b"\n")
    record = json.loads(line)
    record["until"] = until
    return b"%s\n%s\n" % (counter, json.dumps(record).encode())


class _Held(NamedTuple):
    """A slot file of ours, opened: what a lease keeps of it once it is locked."""

    path: str
    fd: int
    identity: tuple[int, int]  # (st_dev, st_ino)
    counter: int = 0  # the length of its counter line, once the grant has written it
    record: bytes = b""  # what the grant wrote: the counter line and the holder's record
    written: bool = True  # False: a file with other names, which lockrun never writes


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
        self._warn, self._note = warn, note
        self._noted: set[str] = set()  # lock files whose records were noted as not believed
        self._fd: int | None = None
        self._identity = (0, 0)  # the directory's (st_dev, st_ino) while _fd is open
        self._writable = False  # _fd passed _check_writable
        self._head: tuple[tuple[object, ...], str, str] | None = None  # see _record_parts

    def _directory(self, *, make: bool = True) -> int:
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
            self._fd, self._identity, self._writable = fd, (info.st_dev, info.st_ino), False
        if make and not self._writable:
            self._check_writable(self._fd)
            self._writable = True
        return self._fd

    @property
    def _dir(self) -> int:
        """The lock directory as `_directory` last found it, at the start of this call."""
        return self._directory() if self._fd is None else self._fd

    def _still_named(self) -> bool:
        """Whether the directory's path still leads to the directory we hold open."""
        try:
            info = os.stat(self.directory, follow_symlinks=False)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self._identity

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

    def _open(self, filename: str) -> _Held:
        """Open (or make) a lock file: a regular file, nothing else; say if it has other names."""
        try:
            try:
                fd = self._open_or_make(filename)
            except FileNotFoundError:
                # Making a plain name fails so only in a directory deleted since
                # _directory looked: open (or make) it again, once.
                self.close()
                fd = self._open_or_make(filename)
        except OSError as err:
            raise self._failure(filename, err) from err
        with _closed_on_error(fd):
            info = self._check(fd, filename)
        path, written = self._path(filename), info.st_nlink == 1
        if not written and self._note is not None and path not in self._noted:
            self._noted.add(path)
            self._note(
                f"lock file {path} has {info.st_nlink} names (hard links): locked, never written"
            )
        return _Held(path, fd, (info.st_dev, info.st_ino), written=written)

    def _failure(self, filename: str, err: OSError) -> ConfigError | BackendUnavailable:
        """Translate *err* of opening *filename*: a symlink there is named with its maker."""
        path = self._path(filename)
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink (docs/security.md)
            try:
                maker = os.stat(filename, dir_fd=self._dir, follow_symlinks=False).st_uid
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
            return os.open(filename, flags, dir_fd=self._dir)
        try:
            mode = 0o600 if self.private else 0o666
            return os.open(filename, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=self._dir)
        except FileExistsError:  # made by another process since: open that
            return os.open(filename, flags, dir_fd=self._dir)

    def _check(self, fd: int, filename: str) -> os.stat_result:
        """Raise `ConfigError` unless the opened *fd* is a regular file.

        One with other names (hard links) may be another file of anyone's: it is locked,
        never written (`_Held.written`). Refusing it let any user who made NAME.lock a
        second name of a file of theirs keep every other user out (docs/security.md).
        """
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file (a FIFO, a device or a socket?)"
            msg = f"lock file {self._path(filename)} {problem}; remove it"
            raise ConfigError(msg)
        return info

    def _path(self, filename: str) -> str:
        return os.path.join(self.directory, filename)

    def _wake_names(self, base: str, slots: int) -> list[str]:
        """Name each slot's wake-up socket: this directory's inode and the lock's base."""
        device, inode = self._identity
        digest = _sha256(f"{device}:{inode}/{base}")
        return [f"lockrun-file/{digest[:40]}/{slot}" for slot in range(slots)]

    def acquire(self, request: Request, deadline: float | None) -> FileLease | None:
        """Take one slot of *request*, queueing FIFO in the kernel until *deadline*."""
        base = _base(request.namespace, request.name)
        self._directory()  # opened, or checked to be still the one its path names
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
            with _closed_on_error(held.fd):
                return self._grant(base, request, slot, held, wake)

    def _wait_for_slot(
        self,
        base: str,
        request: Request,
        deadline: float | None,
        line: contextlib.ExitStack,
    ) -> tuple[int, _Held, socket.socket | None] | None:
        """Queue on NAME.gate, then take a slot as the head (docs/design.md A2).

        *line* closes the gate.
        """
        from lockrun.backends.abstract import GATE_GRACE  # noqa: PLC0415 - semaphores only

        gate = self._open(f"{base}.gate").fd
        line.callback(os.close, gate)  # the next waiter in the kernel's queue becomes the head
        # A one-shot try still waits briefly on the gate: its holder may only be sweeping.
        gate_deadline = None if deadline is None else max(deadline, now() + GATE_GRACE)
        if not wait_flock(gate, gate_deadline):
            return None
        return self._take_slot(base, request.slots, deadline)

    def _acquire_lock(
        self, base: str, request: Request, deadline: float | None
    ) -> FileLease | None:
        """Take the one slot of a lock: flock(2) on NAME.lock, LOCK_SH if shared (A1)."""
        held = self._open(_slot_file(base, 0))
        with _closed_on_error(held.fd):
            # Slot files beyond the first are a semaphore's: one in use would be a mismatch.
            semaphore = self._check_agreement(base, request, first=1)
            with contextlib.ExitStack() as line:  # the gate and a take-over request, if any
                # The uncontended writer takes the lock and touches no other file; a reader
                # must first see in the gate that no writer waits.
                if (request.shared or not try_flock(held.fd)) and not self._wait_in_line(
                    base, request, held, deadline, line
                ):
                    os.close(held.fd)
                    return None
            content = self._content(held, request)
            if not _wait_out(_window(self._believed(held, content), base), deadline):
                os.close(held.fd)
                return None
            if (taker := _taker(held.fd)) is not None:
                raise TakenOver(_taken_by(taker))  # a later acquirer asked: give way
            if request.shared:  # no record, no fence: others share the file
                return FileLease(0, None, held, None)
            return self._grant(base, request, 0, held, None, semaphore=semaphore, content=content)

    def _wait_in_line(
        self,
        base: str,
        request: Request,
        held: _Held,
        deadline: float | None,
        line: contextlib.ExitStack,
    ) -> bool:
        """Queue on NAME.gate, then wait on NAME.lock as the head; True once it is ours.

        Every lockrun waiter passes the gate, which the kernel grants in arrival order, and
        only its holder waits on the lock: flock(2) lets a new LOCK_SH pass a waiting
        LOCK_EX [V], so a reader that came after a queued writer would overtake it. What
        *line* closes, the caller closes once the lock is ours (docs/design.md A1).
        """
        from lockrun.backends.abstract import GATE_GRACE  # noqa: PLC0415 - waiters only

        mode = fcntl.LOCK_SH if request.shared else fcntl.LOCK_EX
        gate = None
        if request.shared:
            gate = self._open(f"{base}.gate").fd
            line.callback(os.close, gate)
            if try_flock(gate) and try_flock(held.fd, mode):
                return True  # no writer holds it, none waits: in beside the other readers
        self._agree(
            base, request, held.identity, self._believed(held, self._content(held, request))
        )
        self._record_parts(request)  # now, not after the wait
        if deadline is not None and deadline <= now() and not request.shared:
            return False  # a one-shot writer: busy
        _load_inotify()  # the bell's library: now, not on the hand-over's path
        if gate is None:
            gate = self._open(f"{base}.gate").fd
            line.callback(os.close, gate)
        if request.take_over:
            if not _ask_to_stop(held.fd) and self._warn is not None:
                self._warn(
                    f"{request.name}: --take-over: cannot ask the holders of {held.path} to "
                    "give way: another process holds a lock over the bytes a request takes "
                    "(a reader of the file may); waiting as any waiter"
                )
            line.callback(_unask, held.fd)  # before we look for requests of others
            with contextlib.suppress(OSError):  # the bell; refreshes would see it anyway
                os.utime(held.fd)
        if request.shared:  # a mark for status: a POSIX lock, which no flock(2) sees (P17)
            with contextlib.suppress(OSError):
                fcntl.lockf(gate, fcntl.LOCK_SH | fcntl.LOCK_NB, 1)
        # A one-shot reader waits briefly for a gate held by a reader on its way in.
        gate_deadline = deadline
        if request.shared and deadline is not None:
            gate_deadline = max(deadline, now() + GATE_GRACE)
        return wait_flock(gate, gate_deadline) and wait_flock(held.fd, deadline, mode)

    def _believed(self, held: _Held, content: bytes) -> bytes:
        """Return what of *content*, read from *held*, may be believed; note what may not.

        A record that another user could have written (docs/security.md) is dropped: only
        the counter line stays, which no decision but the fence's rests on.
        """
        try:
            stranger = _stranger(os.fstat(held.fd))
        except OSError:
            stranger = "a user lockrun cannot tell"
        if stranger is None or not _split(content)[1].strip():
            return content
        if self._note is not None and held.path not in self._noted:
            self._noted.add(held.path)
            self._note(
                f"the record in lock file {held.path} is not believed: {stranger} could have "
                "written it (a --hold-at-least window there holds nothing)"
            )
        return _counter_line(content)

    def _content(self, held: _Held, request: Request) -> bytes:
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
            identity, content = self._peek(_slot_file(base, slot))
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
        record = _record(content, base)
        if record is None or record.slots == request.slots:
            return
        locks = _proc_locks()  # only when a record disagrees: is its writer still there?
        if locks.get(identity, _NO_LOCKS).writers or _window(content, base) is not None:
            raise slots_mismatch(request, record.slots, record.holder)

    def _take_slot(
        self, base: str, slots: int, deadline: float | None
    ) -> tuple[int, _Held, socket.socket | None] | None:
        """As the head of the queue, lock the first free slot file, sleeping between sweeps."""
        from lockrun.backends import abstract  # noqa: PLC0415 - semaphores only

        files: list[_Held] = []
        winner = None
        pause = abstract.TRANSITION
        try:
            # One at a time: those opened before a failure are closed below.
            files.extend(self._open(_slot_file(base, slot)) for slot in range(slots))
            wake_names = self._wake_names(base, slots)
            while True:
                for slot, held in enumerate(files):
                    if try_flock(held.fd):
                        winner = slot
                        return slot, held, abstract.bind_listener(wake_names[slot])
                wait = abstract.remaining(deadline)
                if wait == 0:
                    return None
                conns = [abstract.connect_to(name) for name in wake_names]
                live = [conn for conn in conns if conn is not None]
                if len(live) < slots:  # a holder without a wake-up socket (flock(1), a child)
                    wait, pause = min(wait, pause), min(pause * 2, _SLOW_WAKE)
                else:
                    pause = abstract.TRANSITION
                try:
                    abstract.wait_readable(live, wait)
                finally:
                    for conn in live:
                        conn.close()
        finally:
            for slot, held in enumerate(files):
                if slot != winner:
                    os.close(held.fd)

    def _grant(
        self,
        base: str,
        request: Request,
        slot: int,
        held: _Held,
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
            counter = _split(content)[0]
            if request.slots > 1:
                fence = self._semaphore_fence(base, counter if slot == 0 else None)
            else:
                fence = next_fence(counter)
                if semaphore or not counter:
                    fence = max(fence, next_fence(self._read(f"{base}.fence")))
            line = f"{fence}\n"
            data = f"{line}{self._record_line(request, slot)}\n".encode()
            if not held.written:  # no record: status names the holder from /proc/locks
                return FileLease(slot, fence, held, wake)
            os.pwrite(held.fd, data, 0)
            if len(data) < len(content):  # a longer record was there: cut what is left of it
                os.ftruncate(held.fd, len(data))
        except OSError as err:  # ENOSPC, EIO: we could not record the fence
            raise failure(f"lock files of {request.name} in {self.directory}", err) from err
        return FileLease(slot, fence, held._replace(counter=len(line), record=data), wake)

    def _semaphore_fence(self, base: str, counter: bytes | None) -> int:
        """Draw a semaphore's fence (as its head) and keep it in NAME.fence.

        Above NAME.fence and NAME.lock's counter line, whose *counter* the caller has
        read if it holds that file.
        """
        if counter is None:
            counter = _split(self._peek(_slot_file(base, 0))[1])[0]
        fence_file = self._open(f"{base}.fence")
        try:
            fence = max(next_fence(os.pread(fence_file.fd, 32, 0)), next_fence(counter))
            if fence_file.written:
                _overwrite(fence_file.fd, f"{fence}\n".encode())
        finally:
            os.close(fence_file.fd)
        return fence

    def _read(self, filename: str) -> bytes:
        """Return the start of a lock file of ours that may be missing (then b"").

        Refuses (78) what `_open` refuses: a planted symlink, FIFO or device.
        """
        try:
            fd = os.open(filename, os.O_RDONLY | _OPEN, dir_fd=self._dir)
        except FileNotFoundError:
            return b""
        except OSError as err:
            raise self._failure(filename, err) from err
        try:
            self._check(fd, filename)
            return os.pread(fd, 32, 0)
        finally:
            os.close(fd)

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
        fixed = (request.namespace, request.name, request.slots, holder._replace(since=None))
        if self._head is None or self._head[0] != fixed:
            record: dict[str, object] = {"name": request.name, "namespace": request.namespace}
            record |= {"slots": request.slots} | holder._replace(since=None).to_dict()
            # Holder's fields end with since, slot, expires (tests/backends/test_file.py
            # holds the record to json.dumps's).
            head, _, tail = json.dumps(record).rpartition(_SINCE_AND_SLOT)
            self._head = (fixed, head, tail)
        return self._head[1:]

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders (from the slot files) and waiters (from /proc/locks).

        Makes nothing: a directory that does not exist holds no locks.
        """
        try:
            directory = self._directory(make=False)
        except ConfigError as err:
            if not isinstance(err.__cause__, FileNotFoundError):
                raise
            if name is None:
                return []
            return [LockState(namespace, name, self._path(f"{_base(namespace, name)}.lock"))]
        if name is not None:
            bases = {_base(namespace, name)}
        else:
            bases = set()
            for entry in os.listdir(directory):
                match = re.fullmatch(_LOCK_FILE, entry)
                if match is not None and _namespace_of(match["base"]) == namespace:
                    bases.add(match["base"])
        locks = _proc_locks()
        states = [self._state(base, namespace, name, locks) for base in sorted(bases)]
        return [state for state in states if name is not None or state.holders or state.waiters]

    def _state(
        self, base: str, namespace: str, name: str | None, locks: dict[tuple[int, int], _Locks]
    ) -> LockState:
        holders: list[Holder] = []
        waiters: list[Holder] = []
        slots = None
        lock_name = name or _name_of(base)
        for slot in range(MAX_SLOTS):
            identity, content = self._peek(_slot_file(base, slot))
            if identity is None:
                break
            entry = locks.get(identity, _NO_LOCKS)
            record = _record(content, base)
            if record is not None and _window(content, base) is not None:
                # A --hold-at-least window: the run that left it holds the slot. Whoever has
                # the flock waits out the window (docs/design.md A1): the first in line.
                holders.append(record.holder)
                lock_name, slots = record.name, record.slots
                waiters += [_described(pid, shared=pid in entry.readers) for pid in entry.holding]
            elif entry.readers:  # the kernel's word: shared holders write no record
                holders += [_described(pid, shared=True, slot=slot) for pid in entry.readers]
            elif not entry.holding:
                pass
            elif record is None:
                holders.append(describe_pid(entry.holding[0])._replace(slot=slot))
            else:
                holders.append(record.holder)
                lock_name, slots = record.name, record.slots
            if slot == 0:
                waiters += [
                    _described(pid, shared=pid in entry.shared_waiting) for pid in entry.waiting
                ]
        gate_identity, _ = self._peek(f"{base}.gate")
        if gate_identity is not None:
            gate = locks.get(gate_identity, _NO_LOCKS)
            waiters += [
                _described(pid, shared=pid in gate.marked) for pid in (*gate.holding, *gate.waiting)
            ]
        return LockState(
            namespace,
            lock_name,
            self._path(f"{base}.lock"),
            slots,
            tuple(holders),
            _once(waiters, {holder.pid for holder in holders}),
        )

    def _peek(self, filename: str) -> tuple[tuple[int, int] | None, bytes]:
        """Return the identity and the content of a lock file, if it is a regular file.

        Without its record if another user could have written it (`_stranger`).
        """
        try:
            fd = os.open(filename, os.O_RDONLY | _OPEN, dir_fd=self._dir)
        except OSError:
            return None, b""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # _open reports what is wrong with it
                return None, b""
            content = os.pread(fd, MAX_RECORD + 1, 0)
        except OSError:  # EIO, or a file that is no longer what it was
            return None, b""
        finally:
            os.close(fd)
        if _stranger(info) is not None:  # its record is not believed; its counter is
            content = _counter_line(content)
        return (info.st_dev, info.st_ino), content

    def close(self) -> None:
        """Close the directory."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def _closed_on_error(fd: int) -> Iterator[None]:
    """Close *fd* if the block raises (Ctrl-C included), so no lock is left behind."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _split(content: bytes) -> tuple[bytes, bytes]:
    """Split a slot file into its fence counter line (b"" if none) and its holder record."""
    first, newline, rest = content.partition(b"\n")
    if newline and first.isdigit():
        return first, rest
    return b"", content  # written by an older lockrun, or by someone else


def _counter_line(content: bytes) -> bytes:
    """Return the fence counter line of a slot file alone (b"" if it has none)."""
    counter = _split(content)[0]
    return counter + b"\n" if counter else b""


def _overwrite(fd: int, data: bytes) -> None:
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


class _Record(NamedTuple):
    holder: Holder
    name: str
    slots: int


def _record(content: bytes, base: str) -> _Record | None:
    """Parse the holder record of a slot file of *base*; None for anything else.

    A flock(1) user's pid, or whatever another user of a shared directory wrote: a record
    counts only if it is well formed and names the lock whose file it is in.
    """
    data = read_json(_split(content)[1])
    if not isinstance(data, dict):
        return None
    name, namespace, slots = data.get("name"), data.get("namespace"), data.get("slots")
    if not isinstance(name, str) or not isinstance(namespace, str):
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        return None
    try:
        if _base(namespace, name) != base:
            return None
        return _Record(Holder.from_dict(data), name, slots)
    except (ValueError, UnicodeError):
        return None


def _namespace_of(base: str) -> str:
    return unescape(base.split(".", 1)[0]) if "." in base else DEFAULT_NAMESPACE


def _name_of(base: str) -> str:
    return unescape(base.split(".", 1)[-1])


def _once(waiters: list[Holder], seen: set[int]) -> tuple[Holder, ...]:
    """Return *waiters* without holders (*seen*) and repeats: the head is in gate and lock."""
    kept = []
    for waiter in waiters:
        if waiter.pid not in seen:
            seen.add(waiter.pid)
            kept.append(waiter)
    return tuple(kept)


def _described(pid: int, *, shared: bool, slot: int | None = None) -> Holder:
    return describe_pid(pid)._replace(shared=shared, slot=slot)


def _stranger(info: os.stat_result) -> str | None:
    """Name who other than us, root and our groups could have written the file *info* is of.

    None if nobody else could: the file is ours or root's, or belongs to one of our groups
    and its owner is a member (a set-group-ID directory gives every file made in it its
    group, whoever makes it), and not every user may write it. A group we are in is one
    whose members we share locks with (docs/security.md).
    """
    if info.st_uid not in {0, os.geteuid()} and not (
        info.st_gid in _our_groups() and _member(info.st_uid, info.st_gid)
    ):
        return describe_uid(info.st_uid)
    return "every user" if info.st_mode & stat.S_IWOTH else None


def _our_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _member(uid: int, gid: int) -> bool:
    """Whether user *uid* is in group *gid*, as the user and group databases say."""
    try:
        entry = pwd.getpwuid(uid)
        return gid in os.getgrouplist(entry.pw_name, entry.pw_gid)
    except (KeyError, OSError):  # a uid with no name: a member of nothing we can tell
        return False


def _window(content: bytes, base: str) -> float | None:
    """Return when the --hold-at-least window left in a slot file of *base* ends, if it is open.

    Anyone who may write the file may write a record: an end further away than any window
    lockrun makes (a forged one, a clock stepped back by a year) is none, and a negative or
    non-numeric one is none (docs/security.md). So a forged window can hold the lock for as
    long as a lockrun could, never for ever.
    """
    if _UNTIL not in content:  # the usual file: a counter line and nothing else
        return None
    record = _record(content, base)
    until = None if record is None else record.holder.until
    if until is None or not 0 < until - time.time() <= _LONGEST_WINDOW:
        return None
    return until


def _wait_out(until: float | None, deadline: float | None) -> bool:
    """Sleep, holding the lock, until the window ending *until* (Unix time) is over.

    False at once if *deadline* comes first: busy. Holding the lock keeps our place; the
    waiters behind us stay queued in the kernel (docs/design.md A1).
    """
    if until is None:
        return True
    if deadline is not None and deadline - now() < until - time.time():
        return False
    while (left := until - time.time()) > 0:  # the wall clock, as the window was written
        if deadline is not None and now() >= deadline:  # the clock stepped back
            return False
        time.sleep(min(left, _WINDOW_NAP))
    return True


def _request_lock(kind: int, start: int, length: int = 1) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0)


def _ask_to_stop(fd: int) -> bool:
    """Ask the holders of the lock file open for writing as *fd* to give way (docs/design.md A1).

    The request lasts until `_unask`, or until the last descriptor of this open file is
    closed: it ends with the taker, SIGKILL included. The byte says who asks (the only
    record of it), and only a writer of the lock file can lock it. False if a lock of
    another process's covers the byte: a reader's read lock may (docs/security.md).
    """
    uid = os.geteuid() & 0xFFFF_FFFF
    start = _REQUESTS + (uid << _PID_BITS) + os.getpid() % (1 << _PID_BITS)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request_lock(fcntl.F_WRLCK, start))
    except OSError:  # EAGAIN; EINVAL where there are no OFD locks
        return False
    return True


def _unask(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request_lock(fcntl.F_UNLCK, _REQUESTS, 0))


def _taker(fd: int) -> str | None:
    """Say who asks the holders of the lock file open as *fd* to give way; None: nobody does.

    Only write locks count: a read lock needs no more than read access to the file. And
    only in a file that no user but us, root and our groups could write (`_stranger`): who
    else may write it may take the lock, not stop us. The user and pid are what the
    taker's byte says; no process is looked up (docs/security.md).
    """
    try:
        found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _request_lock(fcntl.F_RDLCK, _REQUESTS, 0))
        if _stranger(os.fstat(fd)) is not None:
            return None
    except OSError:  # EINVAL: no OFD locks here (Linux < 3.15, another system)
        return None
    kind, _, start, length, _ = struct.unpack(_FLOCK, found)
    if kind != fcntl.F_WRLCK or start < _REQUESTS or length != 1:
        return None  # none; or a lock of someone else's over the file, not a request
    uid, pid = divmod(start - _REQUESTS, 1 << _PID_BITS)
    return f"{_user(uid)}@{os.uname().nodename} pid {pid}"


class _Locks(NamedTuple):
    """What /proc/locks says of one file: pids, in the order it lists them."""

    holding: list[int]  # a flock(2) lock held, either kind
    waiting: list[int]  # blocked in flock(2)
    readers: list[int]  # of those holding: LOCK_SH
    writers: list[int]  # of those holding: LOCK_EX
    shared_waiting: list[int]  # of those waiting: LOCK_SH
    marked: list[int]  # POSIX read locks: on NAME.gate, the marks of shared waiters


_NO_LOCKS: Final = _Locks([], [], [], [], [], [])


def _proc_locks() -> dict[tuple[int, int], _Locks]:
    """Map (st_dev, st_ino) to the pids holding and waiting for locks, from /proc/locks.

    A line: ``N: [->] FLOCK|POSIX|OFDLCK ADVISORY READ|WRITE PID MAJ:MIN:INODE START END``.
    """
    found: dict[tuple[int, int], _Locks] = {}
    with open("/proc/locks", encoding="ascii", errors="replace") as table:
        lines = table.read().splitlines()
    for line in lines:
        fields = line.split()
        blocked = fields[1:2] == ["->"]
        fields = fields[2:] if blocked else fields[1:]
        if len(fields) < 5 or fields[0] not in {"FLOCK", "POSIX"}:  # noqa: PLR2004
            continue
        try:
            major, minor, inode = fields[4].split(":")
            identity = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
            pid = int(fields[3])
        except ValueError:
            continue
        entry = found.setdefault(identity, _Locks([], [], [], [], [], []))
        shared = fields[2] == "READ"
        if fields[0] == "POSIX":
            if shared and not blocked:
                entry.marked.append(pid)
        elif blocked:
            entry.waiting.append(pid)
            if shared:
                entry.shared_waiting.append(pid)
        else:
            entry.holding.append(pid)
            (entry.readers if shared else entry.writers).append(pid)
    return found
