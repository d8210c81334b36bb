"""The missing-driver line says what to run for the way lockrun was installed, and it works.

pipx's venv: `pipx inject`; a venv or a Python of one's own: that interpreter's pip; a
system's Python (PEP 668): its package; lockrun.pyz: the driver for the Python that runs it.
The commands the lines print are run as printed (pip's with --dry-run --no-index where the
driver is here already; pipx's, for real, in tests/test_install.py's Debian pipx route).
"""

from __future__ import annotations

import json
import os
import shlex
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lockrun.errors import ExitCode
from tests.support.cli import one_line
from tests.support.servers import free_port, installed, unavailable
from tests.support.users import SYSTEM_PYTHON
from tests.test_pyz import pyz  # noqa: F401 - the fixture: one build a session

ROOT = Path(__file__).parent.parent
NEEDS = "lockrun: postgresql: needs the psycopg module: "
DRIVER = "'psycopg[binary]>=3.1'"  # pyproject.toml's postgres extra
# lockrun in a Python that cannot import psycopg, whatever it has installed.
WITHOUT_PSYCOPG = """\
import runpy, sys
sys.modules["psycopg"] = None
sys.argv = ["lockrun", *sys.argv[1:]]
runpy.run_module("lockrun", run_name="__main__")
"""


def missing_driver_line(python: str | Path, *before: str | Path, **kwargs: Any) -> str:
    """Return the one line lockrun run by *python* (after *before*) prints without psycopg."""
    uri = f"postgresql://lockrun@127.0.0.1:{free_port()}/lockrun"
    result = subprocess.run(
        [str(python), *map(str, before), "--uri", uri, "-n", "hint", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        **kwargs,
    )
    assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
    line = one_line(result.stderr)
    assert line.startswith(NEEDS), line
    return line.removeprefix(NEEDS)


def dry_run(command: str) -> str:
    """Run a printed `… -m pip install …` as pip's --dry-run, offline; return what it said."""
    argv = shlex.split(command)
    at = argv.index("install") + 1
    argv[at:at] = ["--dry-run", "--no-index"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def pipx_shaped_venv(home: Path) -> Path:
    """Make HOME/venvs/lockrun-cli as pipx does: a venv, pipx_metadata.json beside its bin.

    Its site-packages sees this venv's, where lockrun-cli is installed (editable).
    """
    venv = home / "venvs" / "lockrun-cli"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    (venv / "pipx_metadata.json").write_text(json.dumps({"pipx_metadata_version": "0.5"}))
    (purelib,) = venv.glob("lib/python3*/site-packages")
    (purelib / "dev.pth").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n"
    )
    return venv


def test_a_venv_is_told_its_own_interpreters_pip(tmp_path: Path) -> None:
    """In a venv: `<its python> -m pip install 'lockrun-cli[postgres]'`, which resolves there."""
    script = tmp_path / "without_psycopg.py"
    script.write_text(WITHOUT_PSYCOPG)
    hint = missing_driver_line(sys.executable, script)
    assert hint == f"{shlex.quote(sys.executable)} -m pip install 'lockrun-cli[postgres]'"
    said = dry_run(hint)  # this venv's lockrun-cli, installed from the checkout, not an index
    assert "Requirement already satisfied: psycopg[binary]>=3.1" in said, said


@pytest.mark.parametrize("where", ["default", "elsewhere"])
def test_a_pipx_venv_is_told_pipx_inject(tmp_path: Path, where: str) -> None:
    """In pipx's venv: `pipx inject lockrun-cli DRIVER`, with PIPX_HOME if not pipx's own.

    pipx's own: ~/.local/share/pipx (pipx ≥ 1.3) or ~/.local/pipx (older, and Debian 12's).
    """
    home = tmp_path / "home"
    pipx_home = home / ".local" / "share" / "pipx" if where == "default" else tmp_path / "opt"
    venv = pipx_shaped_venv(pipx_home)
    script = tmp_path / "without_psycopg.py"
    script.write_text(WITHOUT_PSYCOPG)
    env = {k: v for k, v in os.environ.items() if k not in {"PIPX_HOME", "XDG_DATA_HOME"}}
    hint = missing_driver_line(venv / "bin" / "python", script, env={**env, "HOME": str(home)})
    said = "" if where == "default" else f"PIPX_HOME={pipx_home} "
    assert hint == f"{said}pipx inject lockrun-cli {DRIVER}"


def test_a_systems_python_is_told_its_package(tmp_path: Path) -> None:
    """Debian's own Python (EXTERNALLY-MANAGED): the system's package, which apt knows."""
    if not os.path.isfile("/usr/lib/python3.11/EXTERNALLY-MANAGED"):
        unavailable(f"{SYSTEM_PYTHON} is not Debian 12's Python 3.11")
    script = tmp_path / "without_psycopg.py"
    script.write_text(WITHOUT_PSYCOPG)
    path = os.pathsep.join([str(ROOT / "src"), site.getsitepackages()[0]])  # click, redis-py
    hint = missing_driver_line(SYSTEM_PYTHON, script, env={**os.environ, "PYTHONPATH": path})
    assert hint == (
        f"install psycopg for {SYSTEM_PYTHON} from the system's packages,"
        " on Debian and Ubuntu: apt install python3-psycopg"
    )
    candidate = subprocess.run(
        [installed("apt-cache"), "policy", "python3-psycopg"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "Candidate: 3." in candidate.stdout, candidate.stdout  # psycopg 3, as lockrun needs


@pytest.mark.slow  # builds lockrun.pyz once a session (test_pyz.py's fixture)
def test_lockrun_pyz_is_told_the_driver_for_the_python_that_runs_it(pyz: Path) -> None:  # noqa: F811
    """lockrun.pyz: the system's package under Debian's Python, that Python's pip under another."""
    if not os.path.isfile("/usr/lib/python3.11/EXTERNALLY-MANAGED"):
        unavailable(f"{SYSTEM_PYTHON} is not Debian 12's Python 3.11")
    more = ' (more: docs/install.md, "One file: lockrun.pyz")'
    # -S: not even a psycopg the machine's Python may have in its site-packages.
    assert missing_driver_line(SYSTEM_PYTHON, "-S", pyz) == (
        f"lockrun.pyz leaves it out; install psycopg for {SYSTEM_PYTHON} from the system's"
        f" packages, on Debian and Ubuntu: apt install python3-psycopg{more}"
    )
    script = pyz.parent / "lockrun-without-psycopg.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(pyz)!r})\n{WITHOUT_PSYCOPG}")
    hint = missing_driver_line(sys.executable, script)  # a venv's Python: its pip may
    assert (
        hint
        == f"lockrun.pyz leaves it out; {shlex.quote(sys.executable)} -m pip install {DRIVER}{more}"
    )
    assert "Requirement already satisfied: psycopg" in dry_run(
        hint.split("; ")[1].removesuffix(more)
    )
