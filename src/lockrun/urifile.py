"""Where the lock URI comes from: an option, a variable, or a file that keeps its password.

docs/semantics.md "Settings from the environment" gives the order; docs/security.md
"Passwords in URIs" says why a file, and what file lockrun agrees to read.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
from typing import TYPE_CHECKING, Final

from lockrun.errors import ConfigError, UsageError
from lockrun.uri import DEFAULT_URI, SCHEMES

if TYPE_CHECKING:
    from collections.abc import Mapping

# systemd.exec(5) "Credentials": LoadCredential=lockrun-uri:/etc/… puts the file at
# $CREDENTIALS_DIRECTORY/lockrun-uri.
CREDENTIAL: Final = "lockrun-uri"
MAX_SIZE: Final = 64 * 1024  # a URI is a line; anything larger was never meant for us
_SCHEME: Final = r"([A-Za-z][A-Za-z0-9+.-]*):"
_KINDS: Final = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def choose_uri(option: str | None, option_file: str | None, environ: Mapping[str, str]) -> str:
    """Return the lock URI: --uri, --uri-file, LOCKRUN_URI, LOCKRUN_URI_FILE, the credential.

    The first that is given wins; an empty variable is an unset one, as click reads them.
    """
    if option is not None and option_file is not None:
        msg = "--uri and --uri-file do not combine: give the URI or the file that holds it"
        raise UsageError(msg)
    if option is not None:
        return option
    if option_file is not None:
        return read_uri_file(option_file, "--uri-file")
    variable, variable_file = environ.get("LOCKRUN_URI"), environ.get("LOCKRUN_URI_FILE")
    if variable and variable_file:
        # As the official Docker images refuse X with X_FILE: which one was meant?
        msg = "LOCKRUN_URI and LOCKRUN_URI_FILE are both set: unset one of them"
        raise ConfigError(msg)
    if variable:
        return variable
    if variable_file:
        return read_uri_file(variable_file, "LOCKRUN_URI_FILE")
    if directory := environ.get("CREDENTIALS_DIRECTORY"):
        path = os.path.join(directory, CREDENTIAL)
        if os.path.lexists(path):  # a unit may have credentials, none of them ours
            return read_uri_file(path, "credential")
    return DEFAULT_URI


def read_uri_file(path: str, source: str) -> str:
    """Return the one-line lock URI in file *path*; else `ConfigError` naming *source* and *path*.

    The file is judged as it was opened (symbolic links followed, as Kubernetes' ``..data``
    links need) and never quoted: it may hold a password alone.
    """
    where = f"{source} {path}"
    try:
        # O_NONBLOCK: a FIFO nobody writes to would block the open itself.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        msg = f"{where}: cannot open it: {getattr(err, 'strerror', None) or err}"
        raise ConfigError(msg) from None
    try:
        data = _read_judged(fd, where)
    finally:
        os.close(fd)
    return _uri_in(data, where)


def _read_judged(fd: int, where: str) -> bytes:
    """Read *fd* if it is a regular file no one but its reader (and root) may read or change."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), "something else")
        raise ConfigError(f"{where}: not a regular file but {kind}")
    if info.st_uid not in {os.geteuid(), 0}:
        # ssh's StrictModes and libpq: another user's file could say anything.
        msg = f"{where}: owned by {_user(info.st_uid)}, not by you or root; chown it"
        raise ConfigError(msg)
    # libpq's rule for a private key (docs/security.md): 0600 or less if it is yours, 0640
    # or less if root's, so that systemd's credentials (root's, readable through an ACL,
    # which shows as a group bit) and Kubernetes' fsGroup secrets are read.
    mode = stat.S_IMODE(info.st_mode)
    fix = "chmod 600 it (root's may be 640)"
    if mode & 0o007:
        raise ConfigError(f"{where}: open to others (mode {mode:04o}); {fix}")
    if mode & (0o037 if info.st_uid == 0 else 0o077):
        raise ConfigError(f"{where}: open to its group (mode {mode:04o}); {fix}")
    if info.st_size > MAX_SIZE:
        raise ConfigError(f"{where}: larger than {MAX_SIZE // 1024} KiB; it holds one URI")
    chunks, size = [], 0
    try:
        while size <= MAX_SIZE and (chunk := os.read(fd, MAX_SIZE + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it: {err.strerror}") from None
    if size > MAX_SIZE:  # it grew, or says it is empty (/proc)
        raise ConfigError(f"{where}: larger than {MAX_SIZE // 1024} KiB; it holds one URI")
    return b"".join(chunks)


def _uri_in(data: bytes, where: str) -> str:
    """Return the URI that *data* holds as its one line; never quote *data* in an error."""
    try:
        text = data.decode("utf-8").strip(" \t\r\n")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8") from None
    problem = None
    if "\0" in text:
        problem = "holds a NUL"
    elif "\n" in text or "\r" in text:
        problem = "holds more than one line; put the lock URI alone on one"
    elif not text:
        problem = "is empty"
    elif (scheme := re.compile(_SCHEME).match(text)) is None or scheme[1].lower() not in SCHEMES:
        known = ", ".join(f"{name}:" for name in SCHEMES)
        problem = (
            f"does not start with a lock URI scheme ({known}); "
            "put the whole URI in it, not a password alone"
        )
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return text


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
