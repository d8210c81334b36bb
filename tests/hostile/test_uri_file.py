"""The lock URI from a file: --uri-file, LOCKRUN_URI_FILE and systemd's credential.

The file holds a password, so lockrun reads it the way libpq reads a private key: a regular
file of its user's or root's, open to nobody else, judged through the descriptor it reads.
Every refusal is one line naming the file, never what it holds (docs/security.md
"Passwords in URIs").
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import TYPE_CHECKING, Final

import pytest

from lockrun import ConfigError, UsageError
from lockrun.urifile import MAX_SIZE, choose_uri, read_uri_file
from tests.support.cli import lockrun, one_line
from tests.support.users import ALICE, MALLORY, Runner, needs_root

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

SECRET: Final = "SECRETPW"  # noqa: S105 - a test's; no message of lockrun's holds it


def secret_file(path: Path, content: bytes | str, mode: int = 0o600) -> Path:
    """Write *content* to *path* with *mode* (not umask's) and return it."""
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def where(result: subprocess.CompletedProcess[str]) -> str:
    """Return the URI an empty `lockrun status` listing says it asked."""
    assert result.returncode == 0, result.stderr
    return result.stdout.rsplit(" at ", 1)[1].strip()


# -- which source wins ----------------------------------------------------------------------


def test_the_command_line_then_the_environment_then_the_credential(tmp_path: Path) -> None:
    """--uri > --uri-file > LOCKRUN_URI > LOCKRUN_URI_FILE > the credential > file:."""
    option_file = secret_file(tmp_path / "option", "file:///option\n")
    variable_file = secret_file(tmp_path / "variable", "file:///variable-file")
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    secret_file(credentials / "lockrun-uri", "  file:///credential \r\n")
    everything = {
        "LOCKRUN_URI": "file:///variable",
        "LOCKRUN_URI_FILE": str(variable_file),
        "CREDENTIALS_DIRECTORY": str(credentials),
    }
    assert choose_uri("file:///o", None, everything) == "file:///o"  # the env is not read
    assert choose_uri(None, str(option_file), everything) == "file:///option"
    del everything["LOCKRUN_URI_FILE"]
    assert choose_uri(None, None, everything) == "file:///variable"
    del everything["LOCKRUN_URI"]
    assert choose_uri(None, None, everything) == "file:///credential"
    everything["LOCKRUN_URI_FILE"] = str(variable_file)
    assert choose_uri(None, None, everything) == "file:///variable-file"
    # A unit with credentials, none of them lockrun's; empty variables are unset ones.
    assert choose_uri(None, None, {"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "file:"
    assert choose_uri(None, None, dict.fromkeys(everything, "")) == "file:"
    (credentials / "lockrun-uri").chmod(0o644)  # refused, not skipped
    with pytest.raises(ConfigError, match=r"^credential .*/lockrun-uri: open to others"):
        choose_uri(None, None, {"CREDENTIALS_DIRECTORY": str(credentials)})
    with pytest.raises(UsageError, match="--uri and --uri-file"):
        choose_uri("file:", str(option_file), {})
    with pytest.raises(ConfigError, match="LOCKRUN_URI and LOCKRUN_URI_FILE are both set"):
        choose_uri(None, None, {"LOCKRUN_URI": "file:", "LOCKRUN_URI_FILE": str(option_file)})


def test_every_command_reads_the_file_and_the_credential(tmp_path: Path, name: str) -> None:
    """`lockrun --uri-file`, `status --uri-file` and a systemd credential reach the backend."""
    locks = tmp_path / "locks"
    uri_file = secret_file(tmp_path / "uri", f"file://{locks}\n")
    ran = lockrun("--uri-file", str(uri_file), "-n", name, "--", "true")
    assert (ran.returncode, ran.stderr) == (0, "")
    assert any(locks.iterdir())  # the lock file, where the file said
    assert where(lockrun("status", "--uri-file", str(uri_file))) == f"file://{locks}"
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    uri_file = uri_file.rename(credentials / "lockrun-uri")
    env = os.environ | {"CREDENTIALS_DIRECTORY": str(credentials)}
    assert where(lockrun("status", env=env)) == f"file://{locks}"
    both = lockrun("status", "--uri", "file:", "--uri-file", str(uri_file))
    assert both.returncode == 64
    assert "--uri and --uri-file" in one_line(both.stderr)
    env |= {"LOCKRUN_URI": "file:", "LOCKRUN_URI_FILE": str(uri_file)}
    twice = lockrun("status", env=env)
    assert twice.returncode == 78
    assert "LOCKRUN_URI and LOCKRUN_URI_FILE are both set" in one_line(twice.stderr)


def test_a_password_from_the_file_is_hidden_like_one_in_a_uri(tmp_path: Path, name: str) -> None:
    """A URI read from a file keeps its password out of every line, as --uri does."""
    uri_file = secret_file(tmp_path / "uri", f"redis://:{SECRET}@127.0.0.1:1/0\n")
    ran = lockrun("--uri-file", str(uri_file), "-n", name, "-v", "--", "true")
    asked = lockrun("status", "--uri-file", str(uri_file), "--json", name)
    for result in (ran, asked):
        assert result.returncode == 69, result.stderr
        assert SECRET not in one_line(result.stderr)
        assert "redis://***@127.0.0.1:1/0" in result.stderr


# -- what is refused ------------------------------------------------------------------------

URI: Final = f"redis://:{SECRET}@127.0.0.1:1/0"


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)  # nobody writes: an open without O_NONBLOCK would hang
    return path


def _loop(path: Path) -> Path:
    path.symlink_to(path)
    return path


def _directory(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


REFUSED: Final[dict[str, tuple[Callable[[Path], Path], str]]] = {
    "others-read": (lambda p: secret_file(p, URI, 0o604), "open to others (mode 0604)"),
    "world": (lambda p: secret_file(p, URI, 0o644), "open to others (mode 0644)"),
    "group-write": (lambda p: secret_file(p, URI, 0o620), "open to its group (mode 0620)"),
    "group-exec": (lambda p: secret_file(p, URI, 0o610), "open to its group (mode 0610)"),
    "directory": (_directory, "not a regular file but a directory"),
    "fifo": (_fifo, "not a regular file but a FIFO"),
    "device": (lambda _: Path("/dev/zero"), "but a character device"),
    "large": (lambda p: secret_file(p, URI + " " * MAX_SIZE), "larger than 64 KiB"),
    "not-utf8": (lambda p: secret_file(p, URI.encode() + b"\xff"), "not UTF-8"),
    "nul": (lambda p: secret_file(p, URI + "\0"), "holds a NUL"),
    "lines": (lambda p: secret_file(p, f"{URI}\nfile:\n"), "holds more than one line"),
    "empty": (lambda p: secret_file(p, ""), "is empty"),
    "blank": (lambda p: secret_file(p, " \n\n"), "is empty"),
    "missing": (lambda p: p, "cannot open it: No such file or directory"),
    "loop": (_loop, "cannot open it: Too many levels of symbolic links"),
    "password-alone": (
        lambda p: secret_file(p, f"{SECRET}\n"),
        "does not start with a lock URI scheme (file:, abstract:, redis:",
    ),
}


@pytest.mark.parametrize(
    ("case", "source"),
    [(case, ("--uri-file", "LOCKRUN_URI_FILE")[index % 2]) for index, case in enumerate(REFUSED)],
)
def test_an_unsafe_or_unusable_file_is_refused_in_one_line(
    tmp_path: Path, case: str, source: str
) -> None:
    """Open to others, not a file, too large, not one line of UTF-8, missing: 78, path only."""
    make, says = REFUSED[case]
    path = make(tmp_path / "uri")
    if source.startswith("-"):
        result = lockrun("status", source, str(path), timeout=20)
    else:
        result = lockrun("status", env=os.environ | {source: str(path)}, timeout=20)
    assert result.returncode == 78, result.stderr
    line = one_line(result.stderr)
    assert line.startswith(f"lockrun: {source} {path}: "), line
    assert says in line
    assert SECRET not in line
    assert result.stdout == ""


def test_symlinks_are_followed_and_the_file_reached_is_judged(tmp_path: Path) -> None:
    """Kubernetes' ..data links: lockrun reads the target, and its mode counts, not the link's."""
    volume = tmp_path / "volume"
    version = volume / "..2026_01_01_00_00_00.000"
    version.mkdir(parents=True)
    target = secret_file(version / "lockrun-uri", f"file://{tmp_path}/locks\n", 0o400)
    (volume / "..data").symlink_to(version.name)
    (volume / "lockrun-uri").symlink_to("..data/lockrun-uri")
    link = str(volume / "lockrun-uri")
    assert where(lockrun("status", "--uri-file", link)) == f"file://{tmp_path}/locks"
    target.chmod(0o444)  # Docker's and Kubernetes' default
    result = lockrun("status", "--uri-file", link)
    assert result.returncode == 78
    assert f"--uri-file {link}: open to others (mode 0444)" in one_line(result.stderr)


@needs_root
def test_odd_files_are_named_and_refused(tmp_path: Path) -> None:
    """A block device, a file of a uid with no name, a path with a NUL: one clear refusal each."""
    for block in (path for path in Path("/dev").iterdir() if path.is_block_device()):
        with pytest.raises(ConfigError, match="not a regular file but a block device"):
            read_uri_file(str(block), "--uri-file")
        break
    nameless = secret_file(tmp_path / "uri", "file:\n")
    os.chown(nameless, 54321, 54321)
    with pytest.raises(ConfigError, match="owned by uid 54321, not by you or root"):
        read_uri_file(str(nameless), "--uri-file")
    with pytest.raises(ConfigError, match="cannot open it: embedded null byte"):
        read_uri_file("/tmp/a\0b", "LOCKRUN_URI_FILE")


# -- other users ----------------------------------------------------------------------------


@needs_root
def test_a_file_of_another_user_is_refused(mallory: Runner, tmp_path: Path) -> None:
    """A file another (non-root) user owns could say anything: refused, as ssh refuses keys."""
    path = secret_file(tmp_path / "uri", "file:///tmp\n", 0o400)
    os.chown(path, mallory.user.uid, mallory.user.gid)
    result = lockrun("status", "--uri-file", str(path))
    assert result.returncode == 78
    line = one_line(result.stderr)
    assert f"--uri-file {path}: owned by {MALLORY} (uid {mallory.user.uid}), " in line


@needs_root
def test_a_user_reads_their_own_file_or_roots_but_no_other(
    alice: Runner, mallory: Runner, shared: Path
) -> None:
    """alice: hers 0600 and root's 0440 with her group (systemd, fsGroup) read; not 0600 root's."""
    uri = f"file://{shared}/locks\n"
    hers = secret_file(shared / "hers", uri)
    os.chown(hers, alice.user.uid, alice.user.gid)
    systemd = secret_file(shared / "systemd", uri, 0o440)
    os.chown(systemd, 0, alice.user.gid)
    roots = secret_file(shared / "roots", uri)
    malloys = secret_file(shared / "mallorys", uri, 0o444)
    os.chown(malloys, mallory.user.uid, mallory.user.gid)
    for readable in (hers, systemd):
        assert where(alice.lockrun("status", "--uri-file", str(readable))) == uri.strip()
    hers.chmod(0o640)  # hers, open to her group: only root's file may be
    grouped = alice.lockrun("status", "--uri-file", str(hers))
    assert grouped.returncode == 78
    assert f"{hers}: open to its group (mode 0640)" in one_line(grouped.stderr)
    denied = alice.lockrun("status", "--uri-file", str(roots))
    assert denied.returncode == 78
    assert f"{roots}: cannot open it: Permission denied" in one_line(denied.stderr)
    planted = alice.lockrun("status", "--uri-file", str(malloys))
    assert planted.returncode == 78
    assert f"{malloys}: owned by {MALLORY} " in one_line(planted.stderr)
    assert pwd.getpwuid(alice.user.uid).pw_name == ALICE
