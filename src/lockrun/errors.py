"""Exit statuses and the exception hierarchy; each exception carries its status.

docs/semantics.md "Exit status" gives what each status means.
"""

from __future__ import annotations

import errno
import os
from enum import IntEnum
from typing import Self

from lockrun.uri import hide


class ExitCode(IntEnum):
    """lockrun's own statuses; any other status is the command's."""

    USAGE = 64  # EX_USAGE; click's 2 is remapped here so it can't pass for the command's 2
    UNAVAILABLE = 69  # EX_UNAVAILABLE: connect, auth, DNS, TLS, timeout before the command ran
    SOFTWARE = 70  # EX_SOFTWARE: a bug in lockrun
    OSERR = 71  # EX_OSERR: out of open files (ulimit -n), as sysexits says of "cannot create pipe"
    BUSY = 75  # EX_TEMPFAIL: held by others and --wait expired; -E moves it
    IOERR = 74  # EX_IOERR: `lockrun status` its answer, or `lockrun acquire` its token, unwritten
    LOST = 76  # EX_PROTOCOL: the lock was lost while the command ran; the command was stopped
    NOPERM = 77  # EX_NOPERM: `lockrun release`: the token's keeper is another user's
    CONFIG = 78  # EX_CONFIG: bad URI, missing driver, unusable lock directory, --slots mismatch
    TAKEN_OVER = 79  # another run took the lock over (--take-over); our command was stopped
    TIMEOUT = 124  # timeout(1): --max-time expired
    CANNOT_EXECUTE = 126  # POSIX shell convention
    NOT_FOUND = 127  # POSIX shell convention
    INTERRUPTED = 130  # 128 + SIGINT while still waiting
    TERMINATED = 143  # 128 + SIGTERM while still waiting


class LockrunError(Exception):
    """Base of every error lockrun reports; ``exit_code`` is the status the CLI exits with.

    Its message never holds a password of a lock URI parsed in this process, whoever wrote
    it (docs/security.md "Passwords in URIs").
    """

    exit_code: int = ExitCode.SOFTWARE
    # The lock it concerns: every lockrun-made status line names it (docs/semantics.md
    # "Exit status"), and `str()` begins with it. Set once, by `about`.
    lock: str | None = None

    def __init__(self, *args: object) -> None:
        """Keep *args*, with every password `lockrun.uri.hide` knows replaced by ``***``."""
        super().__init__(*(hide(arg) if isinstance(arg, str) else arg for arg in args))

    def __str__(self) -> str:
        """Return the message, after the lock's name if it concerns one."""
        text = super().__str__()
        return text if self.lock is None else f"{self.lock}: {text}"

    def about(self, lock: str) -> Self:
        """Name *lock* in the message, unless one is named already; return the error."""
        if self.lock is None:
            self.lock = lock
        return self


class UsageError(LockrunError, ValueError):
    """A bad option value, name or duration."""

    exit_code = ExitCode.USAGE


class ConfigError(LockrunError):
    """A bad URI, a missing driver or an unusable lock directory."""

    exit_code = ExitCode.CONFIG


class BackendUnavailable(LockrunError, ConnectionError):
    """The lock service could not be reached or refused us."""

    exit_code = ExitCode.UNAVAILABLE


class LockBusy(LockrunError, TimeoutError):
    """Every slot stayed taken until the wait ran out."""

    exit_code = ExitCode.BUSY


class OutputError(LockrunError):
    """What lockrun had to print could not be written (stdout closed, a broken pipe)."""

    exit_code = ExitCode.IOERR


class OutOfFiles(LockrunError):
    """Too few descriptors for lockrun's own pipes, sockets and lock files (ulimit -n)."""

    exit_code = ExitCode.OSERR


def out_of_files(err: BaseException) -> bool:
    """Return whether *err*, which no part of lockrun handled, says open files ran out.

    EMFILE or ENFILE, from any system call; or from a lazy import of an extension module,
    whose dlopen error is an ImportError that only names it.
    """
    if isinstance(err, OSError):
        return err.errno in {errno.EMFILE, errno.ENFILE}
    return isinstance(err, ImportError) and os.strerror(errno.EMFILE) in str(err)


class LeaseLost(LockrunError):
    """The lock was lost, or could no longer be confirmed, while held."""

    exit_code = ExitCode.LOST


class NotYours(LockrunError):
    """A keeper's token given by another user, or with a wrong secret (`lockrun release`)."""

    exit_code = ExitCode.NOPERM


class TakenOver(LockrunError):
    """Another acquirer asked with --take-over: the command was stopped, or never started."""

    exit_code = ExitCode.TAKEN_OVER


class CommandNotFound(LockrunError):
    """The command does not exist."""

    exit_code = ExitCode.NOT_FOUND


class CommandNotExecutable(LockrunError):
    """The command exists but could not be executed."""

    exit_code = ExitCode.CANNOT_EXECUTE


class Interrupted(LockrunError):
    """INT, TERM, HUP or QUIT arrived while waiting for the lock; the status is 128+N."""

    exit_code: int = ExitCode.INTERRUPTED

    def __init__(self, message: str, *, signo: int) -> None:
        """Exit 128 + *signo*: 129 for HUP, 130 for INT, 131 for QUIT, 143 for TERM."""
        super().__init__(message)
        self.exit_code = 128 + signo


class TimedOut(LockrunError):
    """--max-time expired; the command was stopped."""

    exit_code = ExitCode.TIMEOUT
