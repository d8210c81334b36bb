"""Where `acquire` puts its token (lockrun.delivery), in-process: --var and --env-file.

A name that ``eval`` would give another meaning is refused (64); an env file is written only
where no one else could have planted something (78), in one append (74 if it fails).
docs/security.md is the contract; tests/hostile/test_keeper.py plants as another user.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

import pytest

from lockrun.delivery import append_line, check_variable, open_env_file
from lockrun.errors import ConfigError, ExitCode, OutputError, UsageError

if TYPE_CHECKING:
    from pathlib import Path


# -- --var ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["DEPLOY_LOCK", "_lock", "lock2", "LOCKRUN_TOKEN", "Path"])
def test_a_name_of_ones_own_is_taken(name: str) -> None:
    """A portable name with no meaning elsewhere, and lockrun's own default, are taken."""
    assert check_variable(name) == name


@pytest.mark.parametrize("name", ["", "2LOCK", "DEPLOY-LOCK", "LOCK ", "DÉPLOI", "a.b", "$X"])
def test_a_name_that_is_no_shell_variable_is_a_usage_error(name: str) -> None:
    """Not [A-Za-z_][A-Za-z0-9_]*: 64, quoting what was given."""
    with pytest.raises(UsageError, match="--var takes a shell variable name") as raised:
        check_variable(name)
    assert raised.value.exit_code == ExitCode.USAGE
    assert repr(name) in str(raised.value)


@pytest.mark.parametrize(
    "name", ["PATH", "IFS", "_", "path", "UID", "TMPDIR", "SSL_CERT_FILE", "NOTIFY_SOCKET"]
)
def test_a_name_a_shell_or_a_library_reads_is_refused(name: str) -> None:
    """Set by ``eval`` and exported to every later step, it would change what runs."""
    with pytest.raises(UsageError, match=f"^--var {name}: a shell, the loader or lockrun"):
        check_variable(name)


@pytest.mark.parametrize(
    "name", ["LD_PRELOAD", "LC_ALL", "BASH_ENV", "PYTHONPATH", "LOCKRUN_URI", "PGPASSWORD"]
)
def test_a_name_of_a_reserved_family_is_refused(name: str) -> None:
    """Whole families are read by someone: the loader's LD_, locales, shells, drivers."""
    with pytest.raises(UsageError, match="name one of your own"):
        check_variable(name)


def test_the_families_are_told_by_case() -> None:
    """Only the spelling a reader uses is refused: `Ld_x` and `bash_x` are no one's."""
    assert check_variable("Ld_PRELOAD") == "Ld_PRELOAD"
    assert check_variable("bash_lock") == "bash_lock"


# -- --env-file -----------------------------------------------------------------------------


def test_a_missing_env_file_is_made_private(tmp_path: Path) -> None:
    """Made 0600, whatever the umask: the token is a secret."""
    path = tmp_path / "env"
    old = os.umask(0)
    try:
        fd = open_env_file(str(path))
    finally:
        os.umask(old)
    os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_env_file_is_appended_to(tmp_path: Path) -> None:
    """What was there stays: CI runners collect every step's lines in one file."""
    path = tmp_path / "github_env"
    path.write_text("EARLIER=1\n")
    fd = open_env_file(str(path))
    try:
        append_line(fd, "DEPLOY_LOCK=lr1.x", "the env file")
    finally:
        os.close(fd)
    assert path.read_text() == "EARLIER=1\nDEPLOY_LOCK=lr1.x\n"


def test_an_env_file_is_closed_on_exec(tmp_path: Path) -> None:
    """The descriptor does not leak into a command lockrun starts."""
    fd = open_env_file(str(tmp_path / "env"))
    try:
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_a_relative_env_file_is_found_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path is the working directory's, as a shell means it."""
    monkeypatch.chdir(tmp_path)
    os.close(open_env_file("env"))
    assert (tmp_path / "env").exists()


def test_an_env_file_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """Never written through a symlink, even one of our own: 78, the target untouched."""
    target = tmp_path / "precious"
    target.write_text("keep\n")
    (tmp_path / "env").symlink_to(target)
    with pytest.raises(ConfigError, match="is a symlink; refusing to write through it"):
        open_env_file(str(tmp_path / "env"))
    assert target.read_text() == "keep\n"


def test_an_env_file_with_a_second_name_is_refused(tmp_path: Path) -> None:
    """A hard link could be anyone's file by another name: 78, untouched."""
    target = tmp_path / "precious"
    target.write_text("keep\n")
    os.link(target, tmp_path / "env")
    with pytest.raises(ConfigError, match="not a regular file with one name"):
        open_env_file(str(tmp_path / "env"))
    assert target.read_text() == "keep\n"


def test_an_env_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO with no reader: refused at once (O_NONBLOCK), not a hang and not a write."""
    os.mkfifo(tmp_path / "env")
    with pytest.raises(ConfigError, match="--env-file"):
        open_env_file(str(tmp_path / "env"))


def test_an_env_file_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    """A directory: 78 naming the option and the path."""
    (tmp_path / "env").mkdir()
    with pytest.raises(ConfigError, match=r"^--env-file .*env: "):
        open_env_file(str(tmp_path / "env"))


def test_an_env_file_in_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    """Its directory is not made: 78 naming it the --env-file directory."""
    with pytest.raises(ConfigError, match="--env-file directory"):
        open_env_file(str(tmp_path / "missing" / "env"))


# -- the append -----------------------------------------------------------------------------


def test_a_line_is_appended_whole_with_its_newline(tmp_path: Path) -> None:
    """One write: the line and its newline, nothing else."""
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        append_line(fd, "A=1", "out")
        append_line(fd, "B=2", "out")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"A=1\nB=2\n"


def test_a_full_disk_is_an_output_error() -> None:
    """ENOSPC (/dev/full): 74, naming what could not be written."""
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OutputError, match=r"^cannot write to the env file: ") as raised:
            append_line(fd, "DEPLOY_LOCK=lr1.x", "the env file")
    finally:
        os.close(fd)
    assert raised.value.exit_code == ExitCode.IOERR


def test_a_closed_pipe_is_an_output_error() -> None:
    """EPIPE (the reader gone): 74, not a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        with pytest.raises(OutputError, match="cannot write to stdout"):
            append_line(write, "x", "stdout")
    finally:
        os.close(write)
