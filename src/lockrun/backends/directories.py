"""Find and open the file backend's lock directory without being redirected.

lockrun often runs as root, in directories that other users can write to. A path is opened
one component at a time, each relative to the directory before it, and a symlink is followed
only if no other user could have planted or changed it: it is ours or root's, in a directory
that no other user can write to (or a sticky one, where others cannot replace it). So a
trailing slash, a symlinked parent or a link swapped in mid-way cannot send root's writes
somewhere else (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from typing import Final, NamedTuple

from lockrun.errors import BackendUnavailable, ConfigError

_PRIVATE: Final = 0o700
_MAX_LINKS: Final = 40  # as the kernel's path walk (ELOOP)
_ROOT_DEFAULT: Final = "/run/lockrun"
_DIRECTORY: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Path and permission problems are the operator's to fix (78); a read-only or full file
# system, or an I/O error, is the lock service being unavailable (69).
_MISCONFIGURED: Final = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.ELOOP,
        errno.EISDIR,
        errno.ENXIO,
        errno.ENODEV,
        errno.ENAMETOOLONG,
    }
)


def failure(what: str, err: OSError) -> ConfigError | BackendUnavailable:
    """Translate an OSError about *what* at the backend boundary."""
    kind = ConfigError if err.errno in _MISCONFIGURED else BackendUnavailable
    return kind(f"{what}: {err.strerror}")


class Default(NamedTuple):
    """The default lock directory: its path, and the parent it is made in."""

    path: str
    parent: str  # must exist; the rest is made 0700


def default_directory() -> Default:
    """Return the default lock directory of this user: one no other user can make first.

    root: /run/lockrun. Others: ~/.cache/lockrun/HOST, the home directory as the password
    database says (cron and a login shell agree on it, where they do not on
    $XDG_RUNTIME_DIR), one per host in case home is shared; /tmp/lockrun-UID when there is
    no home of ours.
    """
    uid = os.geteuid()
    if uid == 0:
        return Default(_ROOT_DEFAULT, "/run")
    host = os.uname().nodename or "localhost"
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        home = ""
    if home.startswith("/") and _is_our_directory(home):
        return Default(os.path.join(home, ".cache", "lockrun", host), home)
    return Default(f"/tmp/lockrun-{uid}", "/tmp")  # noqa: S108 - checked: ours and 0700


def _is_our_directory(path: str) -> bool:
    try:
        fd = open_directory(path)
    except (ConfigError, BackendUnavailable):
        return False
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def open_directory(
    path: str,
    *,
    make_below: str | None = None,
    private: bool = False,
    what: str = "lock directory",
) -> int:
    """Open the absolute directory *path* for ``dir_fd`` use, following only trusted symlinks.

    With *make_below*, the missing directories under that one are made (0700 when
    *private*, else 0777 less the umask). *private* also requires the last to be ours and
    leaves it 0700. Raises `ConfigError` or `BackendUnavailable`; messages call the
    directory *what*.
    """
    try:
        fd = _walk(path, make_below, _PRIVATE if private else 0o777, what)
    except OSError as err:
        raise failure(f"{what} {path}", err) from err
    if private:
        _make_private(path, fd)
    return fd


def _walk(path: str, make_below: str | None, mode: int, what: str) -> int:
    """Open each component of *path* in turn from /; return the last one's descriptor.

    The last component itself must not be a symlink, trusted or not: the directory is
    named as it is.
    """
    fd = os.open("/", _DIRECTORY)
    walked = ""  # the path so far, for messages and for *make_below*
    given = _components(path)
    pending = [(part, at == len(given) - 1) for at, part in reversed(list(enumerate(given)))]
    links = 0
    try:
        while pending:
            name, last = pending.pop()
            info = _lstat(name, fd, mode, make=_under(walked, make_below))
            if not stat.S_ISLNK(info.st_mode):
                inner = os.open(name, _DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd, walked = inner, os.path.normpath(os.path.join(walked or "/", name))
                continue
            links += 1
            where = os.path.join(walked or "/", name)
            target = _trusted_target(where, name, fd, info, last=last, links=links, what=what)
            pending += [(part, False) for part in reversed(_components(target))]
            if target.startswith("/"):
                os.close(fd)
                fd, walked = os.open("/", _DIRECTORY), ""
    except BaseException:
        os.close(fd)
        raise
    return fd


def _components(path: str) -> list[str]:
    """Return the names that *path* walks through, in order (no empty ones, no ".")."""
    return [part for part in path.split("/") if part not in {"", "."}]


def _trusted_target(
    where: str, name: str, fd: int, info: os.stat_result, *, last: bool, links: int, what: str
) -> str:
    """Return where the symlink *name* in *fd* points, if we may follow it; else raise."""
    if last:
        msg = f"{what} {where} is a symlink; refusing to follow it"
        raise ConfigError(msg)
    if links > _MAX_LINKS:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
    _refuse_untrusted_link(where, info, os.fstat(fd), what)
    return os.readlink(name, dir_fd=fd)


def _lstat(name: str, fd: int, mode: int, *, make: bool) -> os.stat_result:
    """Return *name*'s lstat in *fd*; if it is missing and *make*, make it a directory first."""
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        if not make:
            raise
    with contextlib.suppress(FileExistsError):  # another lockrun made it first
        os.mkdir(name, mode, dir_fd=fd)
    return os.stat(name, dir_fd=fd, follow_symlinks=False)


def _under(walked: str, top: str | None) -> bool:
    """Whether the component after *walked* lies below *top* (and may be made); None: none may."""
    if top is None:
        return False
    walked = walked or "/"
    return walked == top or walked.startswith(top.rstrip("/") + "/")


def _refuse_untrusted_link(
    where: str, link: os.stat_result, directory: os.stat_result, what: str = "lock directory"
) -> None:
    """Raise `ConfigError` unless the symlink *where* is one only we or root could change."""
    trusted = (0, os.geteuid())
    writable_by_others = directory.st_uid not in trusted or (
        directory.st_mode & 0o022 and not directory.st_mode & stat.S_ISVTX
    )
    if link.st_uid in trusted and not writable_by_others:
        return
    who = link.st_uid if link.st_uid not in trusted else directory.st_uid
    msg = (
        f"{what} path: {where} is a symlink that {describe_uid(who)} could have planted "
        "or could change; refusing to follow it (name the real directory)"
    )
    raise ConfigError(msg)


def _make_private(path: str, fd: int) -> None:
    """Require the directory *fd* to be ours, and leave it 0700."""
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        msg = (
            f"lock directory {path} belongs to {describe_uid(info.st_uid)}, not to us "
            f"({describe_uid(os.geteuid())}); another user made it first: remove it, or give "
            "--uri file:///DIR"
        )
        raise ConfigError(msg)
    if stat.S_IMODE(info.st_mode) != _PRIVATE:
        os.fchmod(fd, _PRIVATE)


def describe_uid(uid: int) -> str:
    """Name *uid* for a message: ``user NAME``, or ``uid N`` if it has no name."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"
