"""The exception hierarchy (lockrun.errors): statuses, the lock's name, hidden passwords.

docs/semantics.md "Exit status" is what the statuses mean;
docs/security.md "Passwords in URIs" why a message never shows one.
"""

from __future__ import annotations

import errno
import os
import signal

import pytest

from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    ConfigError,
    ExitCode,
    Interrupted,
    LeaseLost,
    LockBusy,
    LockrunError,
    NotYours,
    OutOfFiles,
    OutputError,
    TakenOver,
    TimedOut,
    UsageError,
    out_of_files,
)
from lockrun.uri import parse_uri

PASSWORD = "Hunter2-unit-errors"  # noqa: S105 - parsed below, so `hide` hides it everywhere


def test_each_error_carries_its_status() -> None:
    """The CLI exits with the class's status: a wrong one would pass for another outcome."""
    statuses = {
        UsageError: 64,
        BackendUnavailable: 69,
        LockrunError: 70,
        OutOfFiles: 71,
        OutputError: 74,
        LockBusy: 75,
        LeaseLost: 76,
        NotYours: 77,
        ConfigError: 78,
        TakenOver: 79,
        TimedOut: 124,
        CommandNotExecutable: 126,
        CommandNotFound: 127,
    }
    assert {error: error("x").exit_code for error in statuses} == statuses


def test_every_error_is_a_lockrun_error() -> None:
    """One root: `except LockrunError` catches what any part of lockrun raises."""
    for error in (UsageError, BackendUnavailable, LockBusy, LeaseLost, TakenOver, TimedOut):
        assert issubclass(error, LockrunError)


def test_errors_are_also_the_builtin_they_resemble() -> None:
    """Callers of the Python API may catch ValueError, ConnectionError or TimeoutError."""
    assert isinstance(UsageError("x"), ValueError)
    assert isinstance(BackendUnavailable("x"), ConnectionError)
    assert isinstance(LockBusy("x"), TimeoutError)


@pytest.mark.parametrize(
    ("signo", "status"),
    [(signal.SIGHUP, 129), (signal.SIGINT, 130), (signal.SIGQUIT, 131), (signal.SIGTERM, 143)],
)
def test_an_interruption_exits_128_plus_the_signal(signo: int, status: int) -> None:
    """HUP 129, INT 130, QUIT 131, TERM 143: as a shell reports a command the signal ended."""
    error = Interrupted("TERM while waiting", signo=signo)
    assert error.exit_code == status
    assert str(error) == "TERM while waiting"


def test_an_interruptions_status_is_its_own_not_the_classes() -> None:
    """Two interruptions keep their own statuses: the class default is not overwritten."""
    hup, term = Interrupted("a", signo=1), Interrupted("b", signo=15)
    assert (hup.exit_code, term.exit_code, Interrupted.exit_code) == (129, 143, 130)


def test_an_error_without_a_lock_says_only_its_message() -> None:
    """No lock named: the message alone, no empty prefix."""
    error = BackendUnavailable("connection refused")
    assert error.lock is None
    assert str(error) == "connection refused"


def test_about_names_the_lock_before_the_message() -> None:
    """Every lockrun-made status line begins with the lock it concerns."""
    error = BackendUnavailable("connection refused").about("nightly")
    assert error.lock == "nightly"
    assert str(error) == "nightly: connection refused"


def test_about_names_the_lock_once_and_keeps_the_first() -> None:
    """An error passed up through two layers that both name it says the name once."""
    error = TakenOver("taken over by alice").about("inner").about("outer")
    assert str(error) == "inner: taken over by alice"


def test_about_returns_the_error_itself() -> None:
    """`raise err.about(name)` raises the same object, status and traceback intact."""
    error = LeaseLost("gone")
    assert error.about("x") is error
    assert error.exit_code == ExitCode.LOST


def test_about_leaves_the_args_alone() -> None:
    """Only `str` shows the name: args stay the message as raised (pickling, repr)."""
    error = ConfigError("bad URI").about("job")
    assert error.args == ("bad URI",)


def test_a_password_of_a_parsed_uri_is_hidden_in_any_message() -> None:
    """A message quoting the URI, whoever wrote it, shows *** for its password."""
    parse_uri(f"redis://:{PASSWORD}@db.example:6379/0")
    error = ConfigError(f"cannot use redis://:{PASSWORD}@db.example:6379/0")
    assert PASSWORD not in str(error)
    assert str(error) == "cannot use redis://:***@db.example:6379/0"


def test_a_password_quoted_with_repr_is_hidden_too() -> None:
    """A message built with {value!r} shows the password escaped: hidden all the same."""
    secret = "pa\\ss-unit-errors-42"  # noqa: S105 - made to be looked for
    parse_uri(f"redis://:{secret}@db.example/0")
    error = UsageError(f"bad value {secret!r}")
    assert "ss-unit-errors-42" not in str(error)


def test_a_password_is_hidden_in_the_named_message_too() -> None:
    """`about` adds a lock name, never the password back."""
    parse_uri(f"redis://:{PASSWORD}@db.example:6379/0")
    error = BackendUnavailable(f"auth failed for {PASSWORD}").about("job")
    assert str(error) == "job: auth failed for ***"


def test_arguments_that_are_not_text_are_kept_as_they_are() -> None:
    """Only strings are scrubbed: a number stays a number in args."""
    error = LockrunError("x", 3)
    assert error.args == ("x", 3)


@pytest.mark.parametrize("number", [errno.EMFILE, errno.ENFILE])
def test_out_of_files_is_emfile_or_enfile(number: int) -> None:
    """Descriptors ran out, in this process (EMFILE) or in the system (ENFILE): 71."""
    assert out_of_files(OSError(number, "too many"))


def test_out_of_files_is_not_any_os_error() -> None:
    """Another errno, or an error that is not an OSError, is not out of files."""
    assert not out_of_files(OSError(errno.EACCES, "denied"))
    assert not out_of_files(ValueError("Too many open files"))


def test_out_of_files_reads_an_import_error_that_names_emfile() -> None:
    """A lazy import of an extension module says EMFILE only in its words."""
    message = f"libfoo.so: cannot open shared object file: {os.strerror(errno.EMFILE)}"
    assert out_of_files(ImportError(message))
    assert not out_of_files(ImportError("No module named 'foo'"))
