"""The built wheel in a fresh venv: the command, and its man page and Tab where packagers look.

The ways docs/install.md installs lockrun, as a user runs them: tests/test_install.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import lockrun
from tests.support.servers import installed, unavailable
from tests.support.terminal import press_tab

ROOT = Path(__file__).parent.parent
BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")
# Where man, bash-completion, zsh and fish look, relative to the environment's prefix.
PLACES = {
    "share/man/man1/lockrun.1",
    "share/bash-completion/completions/lockrun",
    "share/zsh/site-functions/_lockrun",
    "share/fish/vendor_completions.d/lockrun.fish",
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SHARED: dict[str, str] = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # venvs and installs, 10 s+ each


def run(*argv: str | Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run *argv*, fail on a non-zero status, and return what it printed."""
    return subprocess.run(
        [str(arg) for arg in argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
        **kwargs,
    )


def environment(bin_dir: Path, home: Path, **extra: str) -> dict[str, str]:
    """Return a clean environment with *bin_dir* first on PATH and *home* as HOME."""
    path = f"{bin_dir}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin"
    return {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from this checkout."""
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", out, ROOT)  # fmt: skip
    (built,) = out.glob("lockrun_cli-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Install the wheel into a fresh venv (its dependencies from the package index)."""
    prefix = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", prefix)
    run(prefix / "bin" / "python", "-m", "pip", "install", "-q", wheel)
    return prefix


def test_the_installed_command_runs_a_locked_command(venv: Path, tmp_path: Path) -> None:
    """`lockrun --version` is this version; a command runs under the lock, which excludes."""
    env = environment(venv / "bin", tmp_path)
    version = run("lockrun", "--version", env=env, cwd=tmp_path)
    assert version.stdout == f"lockrun, version {lockrun.__version__}\n"
    env["LOCKRUN_URI"] = f"file://{tmp_path}/locks"  # not the default directory, others' too
    nested = "lockrun -n demo -- true; echo $LOCKRUN_NAME $LOCKRUN_SLOT $?"
    locked = run("lockrun", "-n", "demo", "--", "sh", "-c", nested, env=env, cwd=tmp_path)
    assert locked.stdout == "demo 0 75\n"  # the inner lockrun found demo busy
    assert locked.stderr == "lockrun: demo busy, held by " + locked.stderr.split(" by ", 1)[1]
    where = run(
        venv / "bin" / "python", "-c", "import lockrun; print(lockrun.__file__)", cwd=tmp_path
    )
    assert where.stdout.startswith(str(venv)), "the test must run the installed copy"


def test_the_wheel_puts_the_man_page_and_completions_where_they_are_looked_for(
    venv: Path, tmp_path: Path
) -> None:
    """The page is found by `man` from PATH, the scripts by bash-completion, zsh and fish."""
    assert set(SHARED.values()) == PLACES
    for source, place in SHARED.items():
        assert (venv / place).read_bytes() == (ROOT / source).read_bytes()
    installed("man")
    env = environment(venv / "bin", tmp_path, MANPATH="", MANWIDTH="80")
    assert run("man", "-w", "lockrun", env=env).stdout == f"{venv}/share/man/man1/lockrun.1\n"
    page = run("man", "lockrun", env=env).stdout
    assert "NAME" in page
    assert "lockrun - run a command" in page.replace("\u2010", "-")
    # bash-completion loads completions from $XDG_DATA_DIRS/bash-completion/completions.
    if not BASH_COMPLETION.exists():
        unavailable("bash-completion is not installed")
    env["XDG_DATA_DIRS"] = f"{venv}/share:/usr/share"
    setup = f"source {BASH_COMPLETION}; echo ready-$?"
    press_tab(
        ["bash", "--norc", "--noprofile", "-i"],
        setup,
        "lockrun --uri-f",
        "lockrun --uri-file ",
        env=env,
    )
    installed("zsh")
    fpath = f"fpath=({venv}/share/zsh/site-functions $fpath)"
    setup = f"{fpath}; autoload -Uz compinit && compinit -u -D; echo ready-$?"
    press_tab(["zsh", "-f", "-i"], setup, "lockrun --uri-f", "lockrun --uri-file", env=env)
    installed("fish")  # fish reads $XDG_DATA_DIRS/fish/vendor_completions.d by itself
    offered = run("fish", "-c", "complete -C 'lockrun --uri-f'", env=env).stdout
    assert offered.split("\t")[0] == "--uri-file"
