"""lockrun.pyz (scripts/build-pyz): reproducible, and whole when the system's Python runs it."""

from __future__ import annotations

import ctypes.util
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

import lockrun
from lockrun.errors import ExitCode
from tests.hostile.test_impostors import STREAMS, Impostor
from tests.support.cli import TEST_TTL, one_line
from tests.support.servers import free_port, installed, unavailable
from tests.support.strategies import libpq_quoted
from tests.support.users import SYSTEM_PYTHON
from tests.test_install import blocks, newcomer

ROOT = Path(__file__).parent.parent
BUILD = ROOT / "scripts" / "build-pyz"
REQUIREMENTS = ROOT / "scripts" / "pyz-requirements.txt"
WHEELS = ROOT / "build" / "pyz-wheels"  # the script's cache: the registry once per checkout
TOO_OLD = re.compile(r"lockrun: needs Python 3\.11 or later, and (.+) is (\d+\.\d+\.\d+)\n")

# Builds take a second; the runs start the system's Python two dozen times.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def build(
    out: Path, *options: str | Path, umask: int = -1, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run scripts/build-pyz --out OUT OPTIONS in this venv (with *umask*, if not -1)."""
    return subprocess.run(
        [sys.executable, BUILD, "--out", out, *options],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, **env},
        umask=umask,
    )


def digest(path: Path) -> str:
    """Return the hex sha256 of *path*."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def pyz(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """Build lockrun.pyz once for the session: the first xdist worker builds, others wait."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # pytest-xdist: the workers' directories share a parent
        shared = shared.parent
    out = shared / "pyz" / "lockrun.pyz"
    with open(shared / "pyz.lock", "a") as serial:
        fcntl.flock(serial, fcntl.LOCK_EX)
        if not out.exists():
            built = build(out)
            assert built.returncode == 0, built.stderr
            assert built.stdout == f"{digest(out)}  {os.path.relpath(out)}\n"
    return out


@pytest.fixture(scope="session")
def system_python() -> str:
    """Return the machine's own Python 3, which has no lockrun, click or redis of its own."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        unavailable(f"{SYSTEM_PYTHON} is not installed")
    bare = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", "import lockrun"], capture_output=True, check=False
    )
    assert bare.returncode == 1, "the system's Python must not see lockrun without the pyz"
    return SYSTEM_PYTHON


@pytest.fixture
def host(pyz: Path, system_python: str, tmp_path: Path) -> dict[str, str]:
    """Return the environment of a host with lockrun.pyz as `lockrun` on PATH and no venv.

    `python3` on PATH is the system's, as the pyz's `#!/usr/bin/env python3` finds it.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lockrun").symlink_to(pyz)  # /usr/local/bin/lockrun, as docs/install.md says
    (bin_dir / "python3").symlink_to(system_python)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "LOCKRUN_URI": f"file://{tmp_path}/locks",
    }


def run(*argv: str | Path, env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run *argv* in *env*; return what it printed, whatever its status."""
    return subprocess.run(
        [str(arg) for arg in argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        **kwargs,
    )


def busy_inside(host: dict[str, str], uri: str, name: str) -> None:
    """Hold *name* at *uri* with the pyz; a second pyz run inside finds it busy (75)."""
    env = {**host, "LOCKRUN_TTL": TEST_TTL}
    # --uri, not LOCKRUN_URI: the outer lockrun hides a password from its command's env.
    quoted = shlex.quote(uri)
    nested = (
        f"lockrun -u {quoted} -n {name} -- true; echo $?; lockrun status -u {quoted} --json {name}"
    )
    held = run("lockrun", "-u", uri, "-n", name, "--", "sh", "-c", nested, env=env)
    assert held.returncode == 0, held.stderr
    status, shown = held.stdout.split("\n", 1)
    assert status == "75"
    assert one_line(held.stderr).startswith(f"lockrun: {name} busy, held by ")
    (state,) = json.loads(shown)  # the holder's record, read back by the pyz's status
    (holder,) = state["holders"]
    assert holder["argv"][-3:] == ["sh", "-c", nested]


def test_two_builds_are_byte_identical(pyz: Path, tmp_path: Path) -> None:
    """Another build, elsewhere, with another umask and time zone, has the same sha256."""
    again = tmp_path / "again" / "lockrun.pyz"
    rebuilt = build(again, umask=0o077, TZ="Pacific/Kiritimati")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert digest(again) == digest(pyz)
    assert os.stat(again).st_mode & 0o777 == 0o755


def test_the_archive_holds_lockrun_its_dependencies_and_their_licences(pyz: Path) -> None:
    """Sorted, timestamped alike, bytecode beside each module, no hiredis; licences, man, Tab."""
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(pyz) as archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        assert names == sorted(names)
        commit = subprocess.run(
            ["git", "-C", ROOT, "log", "-1", "--format=%ct"], capture_output=True, check=True
        )
        when = time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH") or commit.stdout))[:6]
        when = (*when[:5], when[5] // 2 * 2)  # zip's clock counts seconds in twos
        assert {(info.date_time, info.external_attr >> 16) for info in infos} == {(when, 0o100644)}
        assert not [n for n in names if "__pycache__" in n or n.endswith(".so")]
        modules = {name for name in names if name.endswith(".py")}
        assert {name for name in names if name.endswith(".pyc")} == {f"{m}c" for m in modules}
        tops = {name.split("/")[0] for name in names}
        packages = {top for top in tops if "." not in top}
        assert packages == {"async_timeout", "click", "lockrun", "pymysql", "redis", "share"}
        for info in (top for top in tops if top.endswith(".dist-info")):
            assert any(
                re.fullmatch(rf"{re.escape(info)}/(licenses/)?LICEN[CS]E(\.txt)?", n) for n in names
            ), info
        assert f"lockrun_cli-{lockrun.__version__}.dist-info" in tops
        shared = {
            "share/man/man1/lockrun.1": "man/lockrun.1",
            "share/bash-completion/completions/lockrun": "completions/lockrun.bash",
            "share/zsh/site-functions/_lockrun": "completions/_lockrun",
            "share/fish/vendor_completions.d/lockrun.fish": "completions/lockrun.fish",
        }
        for place, source in shared.items():
            assert archive.read(place) == (ROOT / source).read_bytes()
        main = archive.read("__main__.py")
    main.decode("ascii")  # Python 2 reads it too, to say it is too old
    assert b"from lockrun.cli import main" in main


def test_the_system_python_runs_the_pyz_alone(
    host: dict[str, str], pyz: Path, system_python: str, name: str
) -> None:
    """--version, file: and abstract: locks, status and Tab, from the archive only."""
    version = run("lockrun", "--version", env=host)
    assert (version.stdout, version.stderr) == (f"lockrun, version {lockrun.__version__}\n", "")
    code = "import lockrun, click, redis, pymysql; print(lockrun.__file__, redis.__file__)"
    where = run(
        system_python, "-I", "-c", f"import sys; sys.path[:0] = [{str(pyz)!r}]; {code}", env=host
    )
    assert [path.startswith(f"{pyz}/") for path in where.stdout.split()] == [True, True]
    busy_inside(host, host["LOCKRUN_URI"], name)
    busy_inside(host, f"abstract:{name}-", name)
    # Nothing comes from the archive once the command runs, so replacing the file under a
    # running lockrun (an upgrade, docs/install.md) cannot hand it a module of another build.
    watch = (  # a finder first in line hears of every module not yet imported
        "import runpy, sys\n"
        "class Watch:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        print('imported', name, file=sys.stderr)\n"
        "sys.meta_path.insert(0, Watch())\n"
        "sys.argv[0] = 'lockrun'\n"
        f"runpy.run_path({str(pyz)!r}, run_name='__main__')\n"
    )
    argv = ("-n", name, "--", "sh", "-c", "echo started >&2")
    watched = run(system_python, "-I", "-c", watch, *argv, env=host)
    before, started, after = watched.stderr.partition("started\n")
    assert (watched.returncode, started) == (0, "started\n"), watched.stderr
    assert "imported lockrun.backends.file" in before
    assert [line for line in after.splitlines() if re.search(r"\b(lockrun|click)\b", line)] == []
    source = run("lockrun", env={**host, "_LOCKRUN_COMPLETE": "bash_source"})
    assert source.stdout == (ROOT / "completions" / "lockrun.bash").read_text()
    tab = {"_LOCKRUN_COMPLETE": "bash_complete", "COMP_WORDS": "lockrun --uri-f", "COMP_CWORD": "1"}
    completed = run("lockrun", env={**host, **tab, "COMP_LINE": "lockrun --uri-f"})
    assert (completed.stdout, completed.returncode) == ("plain,--uri-file\n", 0), completed.stderr


# Run by the system's Python: the archive's __main__ under a hook that names every source
# compiled from it (zipimport compiles a module it finds no usable bytecode for).
COMPILES = """
import runpy, sys
pyz = sys.argv.pop(1)
def hook(event, args):
    if event == "compile" and str(args[1]).startswith(pyz):
        print("compiled", args[1][len(pyz):], file=sys.stderr)
sys.addaudithook(hook)
sys.argv[0] = "lockrun"
runpy.run_path(pyz, run_name="__main__")
"""


def test_a_run_of_the_build_python_compiles_nothing_and_others_fall_back_to_source(
    pyz: Path, system_python: str, host: dict[str, str], tmp_path: Path, name: str
) -> None:
    """Each module's .pyc is unchecked-hash bytecode for this Python: a run compiles nothing.

    It compiled every module it imported at every run (issue #32). A Python of another
    version finds another magic number and compiles the source: the archive without its
    bytecode stands in for it here.
    """
    magic = importlib.util.MAGIC_NUMBER
    with zipfile.ZipFile(pyz) as archive:
        for info in archive.infolist():
            if info.filename.endswith(".pyc"):
                assert archive.read(info)[:8] == magic + b"\x01\0\0\0", info.filename
        bare = tmp_path / "bare.pyz"
        with zipfile.ZipFile(bare, "w") as stripped:
            for info in archive.infolist():
                if not info.filename.endswith(".pyc"):
                    stripped.writestr(info, archive.read(info))
    same = run(
        system_python, "-c", "import importlib.util as u; print(u.MAGIC_NUMBER.hex())", env=host
    )
    if same.stdout.strip() != magic.hex():
        pytest.skip(f"{system_python} is not this Python's version: its bytecode differs")
    argv = ("--uri", host["LOCKRUN_URI"], "-n", name, "--", "true")
    far = {**host, "TZ": "Pacific/Kiritimati"}  # a timestamp .pyc would be stale here (+14 h)
    for archive_path, compiled in ((pyz, False), (bare, True)):
        ran = run(system_python, "-I", "-c", COMPILES, archive_path, *argv, env=far)
        assert ran.returncode == 0, ran.stderr
        assert ("compiled /lockrun/cli/__init__.py" in ran.stderr) is compiled, ran.stderr
        if not compiled:
            assert ran.stderr == ""


def test_the_pyz_takes_redis_and_mysql_locks(
    host: dict[str, str], redis_uri: str, mysql_uri: str, name: str
) -> None:
    """The bundled redis-py (its Lua scripts) and PyMySQL hold and report real locks."""
    busy_inside(host, redis_uri, name)
    busy_inside(host, mysql_uri, name)


@pytest.mark.parametrize("stream", ["huge-array", "a-byte-at-a-time"])
def test_the_pyz_cuts_a_reply_that_never_ends(host: dict[str, str], stream: str, name: str) -> None:
    """The bundled redis-py reads through lockrun's bounds too: 69 in one line, no hang."""
    impostor = Impostor("ok", plausible=True, scripts={"acquire": STREAMS[stream]})
    try:
        uri = f"redis://127.0.0.1:{impostor.port}/0"
        result = run("lockrun", "-u", uri, "-n", name, "--", "true", env=host)
    finally:
        impostor.close()
    assert result.returncode == ExitCode.UNAVAILABLE, result.stderr
    assert f"127.0.0.1:{impostor.port}" in one_line(result.stderr)


def test_postgres_without_psycopg_says_how_to_add_it(
    host: dict[str, str],
    pyz: Path,
    system_python: str,
    postgres_uri: str,
    tmp_path: Path,
    name: str,
) -> None:
    """No psycopg: 78 and one line saying what to install; psycopg on PYTHONPATH: it runs."""
    uri = f"postgresql://lockrun@127.0.0.1:{free_port()}/lockrun"
    for args in (("-n", name, "--", "true"), ("status",)):
        # -S: not even a psycopg the machine's Python may have in its site-packages.
        result = run(system_python, "-S", pyz, *args, env={**host, "LOCKRUN_URI": uri})
        assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
        assert one_line(result.stderr) == (
            "lockrun: postgresql: needs the psycopg module: lockrun.pyz leaves it out;"
            f" install psycopg for {system_python} from the system's packages, on Debian and"
            " Ubuntu: apt install python3-psycopg"
            ' (more: docs/install.md, "One file: lockrun.pyz")'
        )
    env = {**host, "LOCKRUN_URI": postgres_uri, "PYTHONPATH": psycopg_path(tmp_path)}
    held = run("lockrun", "-n", name, "--", "echo", "ran", env=env)
    assert (held.returncode, held.stdout, held.stderr) == (0, "ran\n", "")


def psycopg_path(tmp_path: Path) -> str:
    """Return a directory for PYTHONPATH with this venv's psycopg, as docs/install.md says.

    psycopg (pure Python, with the machine's libpq) in a directory on PYTHONPATH, as
    `pip install --target` lays it out; here linked from this venv.
    """
    if ctypes.util.find_library("pq") is None:
        unavailable("libpq is not installed")
    import psycopg
    import typing_extensions

    extra = tmp_path / "python"
    extra.mkdir(exist_ok=True)
    for module in (psycopg.__file__, typing_extensions.__file__):
        path = Path(module or "")
        found = path.parent if path.name == "__init__.py" else path
        if not (extra / found.name).exists():
            (extra / found.name).symlink_to(found)
    return str(extra)


def test_the_pyz_says_nothing_of_a_password_in_any_spelling(
    host: dict[str, str], tmp_path: Path, name: str
) -> None:
    """A libpq conninfo's password, or one with no @HOST, shows in no line of the pyz."""
    secret = "QQQQ hunter2 'ZZZZ' \\ %41"  # noqa: S105 - made to be found
    quoted, port = libpq_quoted(secret), free_port()
    env = {**host, "PYTHONPATH": psycopg_path(tmp_path)}
    for uri in (
        f"host=127.0.0.1 port={port} password={quoted} dbname=db",
        f"postgresql://host=127.0.0.1 port={port} password={quoted}",
        f"postgresql://127.0.0.1:{port}/db?dbname={quote(f'x password={quoted}', safe='')}",
        f"redis://u:{quote(secret, safe='')}",
        f"mysql://u:{quote(secret, safe='')}",
    ):
        for args in (("-v", "--wait", "0", "-n", name, "--", "true"), ("status",)):
            result = run("lockrun", *args, env={**env, "LOCKRUN_URI": uri})
            said = result.stdout + result.stderr
            assert result.returncode in {ExitCode.CONFIG, ExitCode.UNAVAILABLE}, said
            assert "Traceback" not in said
            assert [piece for piece in ("QQQQ", "hunter2", "ZZZZ") if piece in said] == [], said


def old_pythons() -> list[str]:
    """Return the interpreters older than 3.11 on this machine: on PATH, or pyenv's."""
    names = ["python2", "python2.7", *(f"python3.{minor}" for minor in range(11))]
    found = {shutil.which(name) for name in names}
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for candidate in glob.glob(f"{pyenv}/versions/*/bin/python"):
        if re.fullmatch(r"(2|3\.([0-9]|10))\.\d+", Path(candidate).parent.parent.name):
            found.add(candidate)
    # Not pyenv's shims, scripts that pick a version and may refuse to.
    return sorted(path for path in found if path and Path(path).read_bytes()[:2] != b"#!")


def test_an_older_python_gets_one_line_not_a_syntax_error(pyz: Path) -> None:
    """Each Python < 3.11 on the machine, and the guard alone: 78 and why, no traceback."""
    with zipfile.ZipFile(pyz) as archive:
        main = archive.read("__main__.py").decode()
    # The guard alone, in this Python made to say it is 3.10 (for machines without an old one).
    pretend = "import sys\nsys.version_info = (3, 10, 14, 'final', 0)\nsys.version = '3.10.14'\n"
    alone = subprocess.run(
        [sys.executable, "-c", pretend + main], capture_output=True, text=True, check=False
    )
    assert (alone.returncode, alone.stdout) == (ExitCode.CONFIG, "")
    assert TOO_OLD.fullmatch(alone.stderr), alone.stderr
    for python in old_pythons():
        result = subprocess.run(
            [python, pyz, "--version"], capture_output=True, text=True, check=False
        )
        assert (result.returncode, result.stdout) == (ExitCode.CONFIG, ""), result.stderr
        said = TOO_OLD.fullmatch(result.stderr)
        assert said is not None, result.stderr
        assert said[1] == python


def fake_wheel(directory: Path, name: str, version: str, *members: str, **requires: str) -> str:
    """Write a small pure-Python wheel with a licence; return its pin line."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        wheel.writestr(f"{info}/METADATA", metadata + "".join(requires.values()))
        wheel.writestr(f"{info}/LICENSE", "MIT\n")
        for member in members:
            wheel.writestr(member, "")
    return f"{name}=={version} --hash=sha256:{digest(path)}"


def test_the_build_refuses_loose_native_unneeded_and_unsafe_wheels(
    pyz: Path, tmp_path: Path
) -> None:
    """Unpinned, not pure, required by nothing, missing, escaping: one line, no archive."""
    assert pyz.exists()  # the session's build filled the wheel cache: no registry below
    wheels, evil = tmp_path / "wheels", tmp_path / "evil"
    shutil.copytree(WHEELS, wheels)
    shutil.copytree(WHEELS, evil)
    lines = REQUIREMENTS.read_text().replace("\\\n", "").splitlines()
    pins = [" ".join(line.split()) for line in lines if "==" in line and line[0] != "#"]
    native = wheels / "hiredis-3.2.1-cp311-cp311-manylinux_2_17_x86_64.whl"
    native.write_bytes(b"not even a zip")
    others = [pin for pin in pins if not pin.startswith("click==")]
    cases = [
        ([*pins, "redis>=8.1"], wheels, "not NAME==VERSION --hash=sha256:HEX: 'redis>=8.1'"),
        (
            [*pins, f"hiredis==3.2.1 --hash=sha256:{digest(native)}"],
            wheels,
            f"{native.name}: not a pure-Python wheel",
        ),
        (
            [*pins, fake_wheel(wheels, "unneeded", "1.0")],
            wheels,
            "pinned but required by nothing: unneeded",
        ),
        (others, wheels, "lockrun-cli requires click>=8.1.7, which is not pinned"),
        (  # a click of our own making, pinned by its hash, with a member outside the archive
            [*others, fake_wheel(evil, "click", "8.5.1", "../../evil.py")],
            evil,
            "click-8.5.1-py3-none-any.whl: unsafe member name '../../evil.py'",
        ),
    ]
    requirements, out = tmp_path / "requirements.txt", tmp_path / "dist" / "lockrun.pyz"
    for text, directory, said in cases:
        requirements.write_text("\n".join(text))
        result = build(out, "--wheels", directory, "--requirements", requirements)
        assert (result.returncode, result.stdout) == (1, ""), said
        assert "downloading" not in result.stderr
        last = result.stderr.splitlines()[-1]
        assert last.startswith("build-pyz: "), result.stderr
        assert last.endswith(said), result.stderr
        assert not out.parent.exists()


def test_the_pyz_installs_with_its_man_page_and_tab_as_docs_install_md_says(
    pyz: Path, tmp_path: Path
) -> None:
    """docs/install.md's lines as root, over a /usr/local of our own: man lockrun and Tab."""
    if os.geteuid() != 0:
        pytest.skip("needs root: /usr/local is another directory in a mount namespace")
    installed("unshare")
    local, home = tmp_path / "usr-local", tmp_path / "home"
    (home / "dist").mkdir(parents=True)
    for directory in ("bin", "etc", "include", "lib", "sbin", "share/man", "src"):
        (local / directory).mkdir(parents=True)  # Debian's empty /usr/local (base-files)
    shutil.copy(pyz, home / "dist" / "lockrun.pyz")  # a clone after scripts/build-pyz
    user = newcomer(home)
    mount = 'mount --bind "$0" /usr/local && exec "$@"'
    user.wrap = ("unshare", "--mount", "sh", "-c", mount, str(local))
    steps = [
        text for _, text in blocks("One file: lockrun.pyz") if "/usr/local/bin/lockrun" in text
    ]
    assert len(steps) == 2  # install it; unpack the man page
    for text in steps:
        user.paste(text)
    user.check_lockrun()
    user.check_man_and_tab()
