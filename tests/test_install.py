"""Each way docs/install.md installs lockrun, run as printed by a newcomer on Debian 12.

The commands come from docs/install.md itself, run by bash in a fresh home with Debian's
`~/.bashrc` and a newcomer's PATH. `lockrun-cli` is not on PyPI yet: pip finds this
checkout's wheel through PIP_FIND_LINKS, as it will find the release on the index; the
dependencies come from the index, through the machine's pip cache.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import lockrun
from lockrun.errors import ExitCode
from tests.support.cli import one_line
from tests.support.servers import free_port, installed, unavailable
from tests.support.terminal import press_tab
from tests.test_readme import CRON_LINE, FENCE

if TYPE_CHECKING:
    from collections.abc import Sequence

ROOT = Path(__file__).parent.parent
INSTALL = ROOT / "docs" / "install.md"
SCRIPTS = {  # what each shell's step writes, and the committed script it must equal
    ".local/share/bash-completion/completions/lockrun": "lockrun.bash",
    ".zfunc/_lockrun": "_lockrun",
    ".config/fish/completions/lockrun.fish": "lockrun.fish",
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")
CRON_PATH = "/usr/bin:/bin"  # Debian's cron, for every job (cron(8))

# Each route makes a venv and installs from the index: 10 to 25 s each.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run(*argv: str | Path, env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run *argv* in *env*; return what it printed, whatever its status."""
    return subprocess.run(
        [str(arg) for arg in argv],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
        **kwargs,
    )


def blocks(title: str, *, page: Path = INSTALL) -> list[tuple[str, str]]:
    """Return the language and text of each fenced block under the heading *title* of *page*."""
    text = page.read_text()
    outside = FENCE.sub(lambda match: re.sub(r"[^\n]", " ", match.group(0)), text)  # same offsets
    heading = re.search(rf"^(#+) {re.escape(title)}\n", outside, re.MULTILINE)
    assert heading, f"{page.name} has no heading {title!r}"
    level = len(heading.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(outside, heading.end())
    section = text[heading.end() : end.start() if end else len(text)]
    return [
        (language, re.sub(rf"(?m)^{indent}", "", body))
        for indent, language, body in FENCE.findall(section)
    ]


@dataclass
class Newcomer:
    """A fresh home on this machine, and the environment of a user who just logged in."""

    home: Path
    env: dict[str, str]
    wrap: Sequence[str] = ()  # a command that every program runs under (a mount namespace)

    def run(self, *argv: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
        """Run *argv* as this user, in the home directory."""
        return run(*self.wrap, *argv, env={**self.env, **env}, cwd=self.home)

    def paste(self, text: str) -> None:
        """Run *text* as the user pastes it into bash; `sudo apt install` lines must be done.

        The tests run as root, as the machine's set-up (scripts/test) installs packages:
        `sudo` is dropped, and an apt line only checks that its packages are there.
        """
        lines = []
        for line in text.splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["sudo", "apt", "install"]:
                for package in words[3:]:
                    status = run("dpkg-query", "-W", "-f=${Status}", package, env=dict(os.environ))
                    if status.stdout != "install ok installed":
                        unavailable(f"Debian's {package} is not installed (apt install {package})")
                continue
            if words[:1] == ["sudo"]:
                if os.geteuid() != 0:
                    pytest.skip("needs root, as docs/install.md's sudo line")
                line = line.removeprefix("sudo ")  # noqa: PLW2901 - the line as root types it
            lines.append(line)
        done = self.run("bash", "-e", "-c", "\n".join(lines))
        assert done.returncode == 0, f"{text}\n{done.stdout}{done.stderr}"

    def check_lockrun(self) -> None:
        """`lockrun` on PATH is this checkout's, and runs a command under a lock."""
        version = self.run("lockrun", "--version")
        assert (version.returncode, version.stdout) == (
            0,
            f"lockrun, version {lockrun.__version__}\n",
        )
        source = self.run("sh", "-c", 'head -n 1 "$(readlink -f "$(command -v lockrun)")"')
        python = source.stdout.removeprefix("#!").split()[0]
        if (Path(python).parent / "activate").exists():  # a venv's, not the .pyz's python3
            code = "import lockrun.cli; print(lockrun.cli.__file__)"
            where = Path(self.run(python, "-c", code).stdout.strip())
            assert where.read_bytes() == (ROOT / "src/lockrun/cli/__init__.py").read_bytes()
        uri = f"file://{self.home}/locks"
        ran = self.run("lockrun", "-u", uri, "-n", "hello", "--", "echo", "ran")
        assert (ran.returncode, ran.stdout, ran.stderr) == (0, "ran\n", "")

    def check_man_and_tab(self) -> None:
        """`man lockrun` finds the page; after the Shell completion steps, Tab in each shell."""
        installed("man")
        found = self.run("man", "-w", "lockrun")
        assert found.returncode == 0, found.stderr
        page = self.run("man", "lockrun", MANWIDTH="80")
        assert "lockrun - run a command" in page.stdout.replace("\u2010", "-"), page.stderr
        for language, text in blocks("Shell completion"):
            if language == "zsh":  # "and ~/.zshrc puts that directory on fpath"
                (self.home / ".zshrc").write_text(text)
            else:
                self.paste(text)
        for place, committed in SCRIPTS.items():
            assert (self.home / place).read_text() == (ROOT / "completions" / committed).read_text()
        if not BASH_COMPLETION.exists():
            unavailable("bash-completion is not installed")
        # Debian's ~/.bashrc (from /etc/skel) loads bash-completion; the script loads at Tab.
        bash = [*self.wrap, "bash", "-i"]
        press_tab(bash, "echo ready-$?", "lockrun --uri-f", "lockrun --uri-file ", env=self.env)
        installed("zsh")
        zsh = [*self.wrap, "zsh", "-i"]
        press_tab(zsh, "echo ready-$?", "lockrun --uri-f", "lockrun --uri-file", env=self.env)
        installed("fish")
        offered = self.run("fish", "-c", "complete -C 'lockrun --uri-f'")
        assert offered.stdout.split("\t")[0] == "--uri-file", offered.stderr


def newcomer(home: Path, wheels: Path | None = None) -> Newcomer:
    """Return a newcomer in the empty *home*, pip finding this checkout's wheel in *wheels*."""
    for dotfile in (".bashrc", ".profile"):  # what useradd -m copies from /etc/skel
        shutil.copy(f"/etc/skel/{dotfile}", home / dotfile)
    env = {
        "HOME": str(home),
        "PATH": f"{home}/.local/bin:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": "/bin/bash",
        # The machine's pip settings (index, proxy) and its cache, not a fresh home's empty one.
        "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR") or os.path.expanduser("~/.cache/pip"),
    }
    env |= {
        key: value
        for key, value in os.environ.items()
        if key.startswith("PIP_") or key.lower() in {"http_proxy", "https_proxy", "no_proxy"}
    }
    if wheels is not None:
        env["PIP_FIND_LINKS"] = f"{wheels} {os.environ.get('PIP_FIND_LINKS', '')}".strip()
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    return Newcomer(home, env)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a directory with this checkout's wheel, where pip finds `lockrun-cli`."""
    out = tmp_path_factory.mktemp("wheels")
    built = run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", out, ROOT, env=dict(os.environ),
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    return out


def debian_pipx() -> str:
    """Return Debian's own pipx (apt install pipx), not the dev extra's."""
    if not os.access("/usr/bin/pipx", os.X_OK):
        unavailable("Debian's pipx is not installed (apt install pipx)")
    return "/usr/bin/pipx"


def test_debians_pipx_gives_lockrun_postgres_the_man_page_and_tab(
    wheels: Path, tmp_path: Path
) -> None:
    """Debian 12's pipx (1.1.0): docs/install.md's pipx steps, then man, Tab and crontabs."""
    debian_pipx()
    user = newcomer(tmp_path, wheels)
    assert (
        user.run("pipx", "--version").stdout.strip()
        == run("/usr/bin/pipx", "--version", env=user.env).stdout.strip()
    )
    install, *others = blocks("pipx")
    user.paste(install[1])
    # Without psycopg, the one line names pipx's command, which works as printed.
    uri = f"postgresql://lockrun@127.0.0.1:{free_port()}/lockrun"
    missing = user.run("lockrun", "-u", uri, "-n", "pg", "--", "true")
    assert (missing.returncode, missing.stdout) == (ExitCode.CONFIG, ""), missing.stderr
    needs = "lockrun: postgresql: needs the psycopg module: "
    hint = one_line(missing.stderr).removeprefix(needs)
    assert hint == "pipx inject lockrun-cli 'psycopg[binary]>=3.1'", missing.stderr
    user.paste(hint)
    for _, text in others:  # docs/install.md's own `pipx inject` repeats it: nothing to do
        user.paste(text)
    user.check_lockrun()
    # pipx inject: psycopg is there, so a PostgreSQL URI gets as far as the server.
    postgres = user.run("lockrun", "-u", uri, "-n", "pg", "--", "true")
    assert postgres.returncode == ExitCode.UNAVAILABLE, postgres.stderr
    # The API needs a venv of the application's own: pipx's copy is not importable.
    assert user.run("python3", "-c", "import lockrun").returncode == 1
    user.check_man_and_tab()
    check_crontab_lines(user)


def test_a_recent_pipx_links_the_man_page_itself(wheels: Path, tmp_path: Path) -> None:
    """A recent pipx with its own defaults (no PIPX_* set): the same steps, man and Tab."""
    user = newcomer(tmp_path, wheels)
    recent = Path(sys.executable).parent / "pipx"  # the dev extra's, as `pipx install pipx`
    if not recent.exists():
        unavailable("the dev extra's pipx is not installed")
    (tmp_path / ".local" / "bin").mkdir(parents=True)
    (tmp_path / ".local" / "bin" / "pipx").symlink_to(recent)
    assert not any(key.startswith("PIPX_") for key in user.env)
    install, *others = blocks("pipx")
    user.paste(install[1])
    user.check_lockrun()
    assert user.run("man", "-w", "lockrun").returncode == 0, "the pipx links no man page"
    for _, text in others:
        if "pipx inject" not in text:  # Debian's pipx tries it; the psycopg wheel is 4 MB
            user.paste(text)
    user.check_man_and_tab()


def test_a_venv_gives_the_command_the_api_and_the_man_page(wheels: Path, tmp_path: Path) -> None:
    """Debian's python3 -m venv and its pip; plain pip outside it is refused, as said."""
    user = newcomer(tmp_path, wheels)
    refused = user.run("python3", "-m", "pip", "install", "lockrun-cli")
    assert refused.returncode != 0
    said = refused.stderr
    assert "externally-managed-environment" in said or "No module named pip" in said, said
    for _, text in blocks("A venv"):
        user.paste(text)
    venv = tmp_path / "venvs" / "lockrun"
    api = user.run(venv / "bin" / "python", "-c", "import lockrun; print(lockrun.__version__)")
    assert api.stdout == f"{lockrun.__version__}\n", api.stderr
    user.env["PATH"] = f"{venv}/bin:{user.env['PATH']}"  # as `. ~/venvs/lockrun/bin/activate`
    user.check_lockrun()
    check_packaged_places(user, venv)
    user.check_man_and_tab()


def check_packaged_places(user: Newcomer, prefix: Path) -> None:
    """Check the wheel's page and scripts under *prefix*/share, where packagers put them.

    bash-completion and fish read `$XDG_DATA_DIRS` (`/usr/local/share:/usr/share` by
    default), zsh its `fpath`: set here to the venv's, as a package's would be the system's.
    """
    shared: dict[str, str] = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"]
    assert len(shared) == len(SCRIPTS) + 1
    for source, place in shared.items():
        assert (prefix / place).read_bytes() == (ROOT / source).read_bytes(), place
    env = {**user.env, "XDG_DATA_DIRS": f"{prefix}/share:/usr/share"}
    if not BASH_COMPLETION.exists():
        unavailable("bash-completion is not installed")
    bash = ["bash", "--norc", "--noprofile", "-i"]
    setup = f"source {BASH_COMPLETION}; echo ready-$?"
    press_tab(bash, setup, "lockrun --uri-f", "lockrun --uri-file ", env=env)
    installed("zsh")
    setup = f"fpath=({prefix}/share/zsh/site-functions $fpath); autoload -Uz compinit"
    setup += " && compinit -u -D; echo ready-$?"
    press_tab(["zsh", "-f", "-i"], setup, "lockrun --uri-f", "lockrun --uri-file", env=env)
    installed("fish")
    offered = run("fish", "-c", "complete -C 'lockrun --uri-f'", env=env).stdout
    assert offered.split("\t")[0] == "--uri-file"


def crontab_lines() -> list[tuple[dict[str, str], str]]:
    """Return each crontab job of README.md and docs/deployment.md's "cron", and its variables."""
    jobs: list[tuple[dict[str, str], str]] = []
    readme = (ROOT / "README.md").read_text()
    texts = [body for _, _, body in FENCE.findall(readme)]
    texts += re.findall(r"(?m)^ {4}(\S.*)$", FENCE.sub("", readme))
    texts += [text for _, text in blocks("cron", page=ROOT / "docs" / "deployment.md")]
    for text in texts:
        variables: dict[str, str] = {}
        for line in (line.strip() for line in text.splitlines()):
            setting = re.fullmatch(r"([A-Za-z_]\w*)\s*=\s*(.*)", line)
            if setting and not CRON_LINE.match(line):
                variables[setting[1]] = setting[2]
            elif CRON_LINE.match(line) and "lockrun" in line:
                jobs.append((dict(variables), line.split(None, 5)[5]))
    return jobs


def check_crontab_lines(user: Newcomer) -> None:
    """Run each crontab job as cron does: `/bin/sh -c` in HOME, with cron's environment only.

    The user's own parts are stood in for: a `/opt/…` script by one that says it ran, and
    the lock service (the crontab's Redis, or root's /run/lockrun) by a directory of this home.
    """
    jobs = crontab_lines()
    assert len(jobs) >= 4
    (user.home / "batch.py").write_text("print('batch ran')\n")
    for variables, command in jobs:
        for script in set(re.findall(r"/opt/\S+", command)):
            stub = user.home / script.lstrip("/")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("#!/bin/sh\necho batch ran\n")
            stub.chmod(0o755)
            command = command.replace(script, str(stub))  # noqa: PLW2901 - the stand-in
        cron = {
            "PATH": CRON_PATH,
            "SHELL": "/bin/sh",
            "HOME": str(user.home),
            "LOGNAME": "root",
            **variables,
        }
        cron.pop("MAILTO", None)
        cron["LOCKRUN_URI"] = f"file://{user.home}/locks"  # not root's /run/lockrun, others'
        result = run("/bin/sh", "-c", command, env=cron, cwd=user.home)
        assert (result.returncode, result.stdout) == (0, "batch ran\n"), (command, result.stderr)
