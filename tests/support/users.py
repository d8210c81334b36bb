"""Real other Unix users for the multi-user tests, and a lockrun they can run.

Loaded by tests/conftest.py as a plugin, like chaos.rig. The users are made once on the
machine (useradd) and kept: ``lockrun-mallory`` plants, squats and spoofs; ``lockrun-alice``
(with a home) is a victim who is not root. Their lockrun is a copy of src/lockrun and click
in a world-readable directory, run by the system's Python 3.11: the checkout, the venv and
pyenv's interpreter may sit where other users cannot read (/root is 0700).
"""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import click
import pytest

import lockrun

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

MALLORY: Final = "lockrun-mallory"
ALICE: Final = "lockrun-alice"
# A Python without lockrun: the machine's own, or the interpreter scripts/pythons tests the
# pyz on (tests/portable.txt).
SYSTEM_PYTHON: Final = os.environ.get("LOCKRUN_TEST_SYSTEM_PYTHON", "/usr/bin/python3")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


class User(NamedTuple):
    """A real Unix user the tests act as."""

    name: str
    uid: int
    gid: int
    home: str


def ensure_user(name: str, *, home: bool) -> User:
    """Return Unix user *name*, made now if the machine does not have it yet."""
    # One useradd at a time, across xdist workers: two at once may pick the same uid.
    with open("/tmp/lockrun-test-users.lock", "a") as serial:
        fcntl.flock(serial, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            made = "--create-home" if home else "--no-create-home"
            useradd = ["useradd", "--system", "--shell", "/bin/sh", "--home-dir", f"/home/{name}"]
            subprocess.run(
                [*useradd, made, name],
                capture_output=True,
                check=True,
            )
            entry = pwd.getpwnam(name)
    if home and not os.path.isdir(entry.pw_dir):
        os.makedirs(entry.pw_dir, mode=0o755, exist_ok=True)
        os.chown(entry.pw_dir, entry.pw_uid, entry.pw_gid)
    return User(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


class Runner:
    """Runs programs, lockrun among them, as another user."""

    def __init__(self, user: User, runtime: Path) -> None:
        """Act as *user*; *runtime* holds the copy of lockrun and click they may read."""
        self.user = user
        self.runtime = runtime

    def env(self, **extra: str) -> dict[str, str]:
        """Return a clean environment for the user."""
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.user.home,
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(self.runtime),
            "PYTHONDONTWRITEBYTECODE": "1",
            **extra,
        }

    def _as_user(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Return *kwargs* for subprocess, to run as the user, in /, with a clean env."""
        kwargs.setdefault("env", self.env())
        return kwargs | {
            "user": self.user.uid,
            "group": self.user.gid,
            "extra_groups": [],
            "cwd": "/",
            "text": True,
        }

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start *argv* as the user, in /."""
        return subprocess.Popen(list(argv), **self._as_user(kwargs))

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run *argv* as the user to completion, output captured."""
        kwargs.setdefault("timeout", 60)
        return subprocess.run(list(argv), capture_output=True, check=False, **self._as_user(kwargs))

    def lockrun(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``lockrun ARGS`` as the user."""
        return self.run([self.python_path, "-m", "lockrun", *args], **kwargs)

    def python(self, code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``python -c CODE ARGS`` as the user; its stdout is a pipe."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        return self.popen([self.python_path, "-c", code, *args], **kwargs)

    @property
    def python_path(self) -> str:
        """The interpreter other users can run."""
        return SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else sys.executable


@pytest.fixture(scope="session")
def runtime() -> Iterator[Path]:
    """Copy lockrun and click where every user may read them, compiled."""
    root = Path(tempfile.mkdtemp(prefix="lockrun-runtime-", dir="/tmp"))
    for package in (lockrun, click):
        source = Path(package.__file__ or "").parent
        shutil.copytree(source, root / source.name, ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(str(root), quiet=1)
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)  # noqa: S103 - other users run this copy
        for file in files:
            os.chmod(os.path.join(directory, file), 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mallory(runtime: Path) -> Runner:
    """Return a co-tenant with no home who plants, squats and spoofs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as other users")
    return Runner(ensure_user(MALLORY, home=False), runtime)


@pytest.fixture(scope="session")
def alice(runtime: Path) -> Runner:
    """Return a user with a home who is not root: the victim of the non-root cases."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as other users")
    return Runner(ensure_user(ALICE, home=True), runtime)


@pytest.fixture
def shared() -> Iterator[Path]:
    """Return a directory every user may write to, sticky like /tmp, outside pytest's 0700."""
    path = Path(tempfile.mkdtemp(prefix="lockrun-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
