"""--help reads like a Unix tool's: grouped, one line an option, and an example that runs.

Each help is read as a user sees it, from `python -m lockrun … --help` in a subprocess; the
examples are run as printed, by sh, with `lockrun` on PATH and a lock URI of the test's own.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING, Final

import click
import pytest

from lockrun import cli
from lockrun.cli.params import Grouped
from tests.support.cli import lockrun, wait_for

if TYPE_CHECKING:
    from pathlib import Path

COMMANDS: Final = {"": cli.run_command} | {
    word: command for word, (command, _) in cli.SUBCOMMANDS.items()
}
WIDTH: Final = 80


@functools.cache
def shown(word: str) -> str:
    """Return the --help of *word* ('' for the run) as printed on a wide terminal."""
    result = lockrun(*[word][: bool(word)], "--help", env=os.environ | {"COLUMNS": "200"})
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    return result.stdout


def _options(command: click.Command) -> set[str]:
    """Return the names the groups use for *command*'s options: its params' and "help"."""
    names = {
        str(param.name)
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden
    }
    return names | {"help"}


@pytest.mark.parametrize("word", list(COMMANDS), ids=lambda word: word or "run")
def test_every_option_is_in_exactly_one_group(word: str) -> None:
    """Each option of the command is listed under one heading, and no heading names another."""
    command = COMMANDS[word]
    assert isinstance(command, Grouped)
    grouped = [name for _, names in command.groups for name in names]
    assert sorted(grouped) == sorted(_options(command))


@pytest.mark.parametrize("word", list(COMMANDS), ids=lambda word: word or "run")
def test_each_heading_shows_its_options_one_line_each(word: str) -> None:
    """Under each heading, each option of its group has one line, and nothing else is there."""
    command = COMMANDS[word]
    assert isinstance(command, Grouped)
    sections = dict(re.findall(r"^(\S[^\n]*):\n((?:  [^\n]*\n)+)", shown(word), re.MULTILINE))
    for heading, names in command.groups:
        lines = sections[heading].splitlines()
        assert len(lines) == len(names), sections[heading]
        for line, name in zip(lines, names, strict=True):
            assert line.startswith("  -"), line
            spelled = re.findall(r"--[\w-]+", line.split("  ")[1])
            assert f"--{name.replace('_', '-').removeprefix('as-')}" in spelled, line


def test_the_run_help_lists_the_subcommands_and_the_groups() -> None:
    """`lockrun --help` names each subcommand on a line of its own, then the five groups."""
    text = shown("")
    for word, (_, what) in cli.SUBCOMMANDS.items():
        assert re.search(rf"^  {word} +{re.escape(what)}$", text, re.MULTILINE), word
    headings = re.findall(r"^(\S[^\n]*):$", text, re.MULTILINE)
    assert headings == [
        "Subcommands (lockrun SUBCOMMAND --help)",
        "Locking",
        "Waiting and time limits",
        "Modes",
        "Monitoring",
        "Output",
    ]
    assert len(text.splitlines()) <= 55  # flock's is 24; it was 72 lines at 80 columns


@pytest.mark.parametrize("word", list(COMMANDS), ids=lambda word: word or "run")
def test_help_fits_80_columns_and_breaks_no_word(word: str) -> None:
    """No line is wider than 80 columns, and none ends in a word cut at a hyphen."""
    lines = shown(word).splitlines()
    assert [line for line in lines if len(line) > WIDTH] == []
    assert [line for line in lines if re.search(r"\w-$", line)] == []


@pytest.mark.parametrize("word", list(COMMANDS), ids=lambda word: word or "run")
def test_help_names_no_file_of_the_repository(word: str) -> None:
    """An installed user has no docs/: help points at man lockrun instead."""
    assert "docs/" not in shown(word)
    assert ".md" not in shown(word)


def example(word: str) -> str:
    """Return the shell lines of the command's example, as printed (indent removed)."""
    found = re.search(r"^  Example: [^\n]*\n((?:    [^\n]*\n)+)", shown(word), re.MULTILINE)
    assert found is not None, shown(word)
    return "".join(line.removeprefix("    ") + "\n" for line in found[1].splitlines())


@pytest.mark.parametrize("word", list(COMMANDS), ids=lambda word: word or "run")
def test_every_lockrun_of_the_example_parses(word: str) -> None:
    """Each `lockrun …` in the example is a command line lockrun takes, values and all."""
    invocations = [
        words[words.index("lockrun") + 1 :]
        for line in example(word).splitlines()
        for part in re.split(r"&&|\|\||;|\$\(|\)", line)
        if "lockrun" in (words := shlex.split(part.replace('"', " ")))
    ]
    assert invocations, example(word)
    for args in invocations:
        command, prog, rest = cli.dispatch(list(args))
        with command.make_context(prog, rest, auto_envvar_prefix="LOCKRUN"):
            pass  # parsed, every value converted: a usage error would have raised


@pytest.fixture
def shell(tmp_path: Path, file_uri: str) -> dict[str, str]:
    """Return an environment where `lockrun` is on PATH and the lock URI is the test's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "lockrun"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m lockrun "$@"\n')
    shim.chmod(0o755)
    return os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOCKRUN_URI": file_uri}


def step(path: Path, lock: str) -> None:
    """Write the script *path*, which records whether *lock* is held while it runs."""
    path.write_text(f"#!/bin/sh\nlockrun status --check -q {lock}; echo $? >> {path}.held\n")
    path.chmod(0o755)


def run_example(word: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the example of *word* with sh, then say `reached` if it went on to the end."""
    return subprocess.run(
        ["/bin/sh", "-c", f"{example(word)}echo reached"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def held(lock: str, env: dict[str, str]) -> bool:
    """Return whether *lock* is held now (`lockrun status --check`)."""
    status = lockrun("status", "--check", "-q", lock, env=env).returncode
    assert status in {0, 75}
    return status == 75


def test_the_run_example_runs_its_script_under_the_lock(
    shell: dict[str, str], tmp_path: Path
) -> None:
    """`lockrun --name backup … -- ./backup.sh`: the script runs, holding backup."""
    step(tmp_path / "backup.sh", "backup")
    result = run_example("", shell, tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "reached\n", "")
    assert (tmp_path / "backup.sh.held").read_text() == "75\n"
    assert not held("backup", shell)


def test_the_status_example_skips_while_the_lock_is_held(
    shell: dict[str, str], tmp_path: Path
) -> None:
    """`lockrun status --check -q backup || exit 0` goes on when free, stops when held."""
    free = run_example("status", shell, tmp_path)
    assert (free.returncode, free.stdout, free.stderr) == (0, "reached\n", "")
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        ["lockrun", "-n", "backup", "--", "sh", "-c", f"touch {ready}; read _"],
        env=shell,
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(ready.exists, what="the holder's command")
        busy = run_example("status", shell, tmp_path)
        assert (busy.returncode, busy.stdout, busy.stderr) == (0, "", "")
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0


def test_the_acquire_example_holds_the_lock_over_the_step(
    shell: dict[str, str], tmp_path: Path
) -> None:
    """`TOKEN=$(lockrun acquire …)`, ./deploy.sh, release: deploy is held during the step."""
    step(tmp_path / "deploy.sh", "deploy")
    result = run_example("acquire", shell, tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "reached\n", "")
    assert (tmp_path / "deploy.sh.held").read_text() == "75\n"
    assert not held("deploy", shell)


def test_the_release_example_releases_an_acquired_lock(
    shell: dict[str, str], tmp_path: Path
) -> None:
    """`lockrun release "$TOKEN"` with the token an acquire printed: the lock is free."""
    taken = lockrun("acquire", "--owner", "none", "--max-time", "5m", "deploy", env=shell)
    assert taken.returncode == 0, taken.stderr
    assert held("deploy", shell)
    result = run_example("release", shell | {"TOKEN": taken.stdout.strip()}, tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "reached\n", "")
    assert not held("deploy", shell)


def test_the_renew_example_holds_the_lock_over_both_steps(
    shell: dict[str, str], tmp_path: Path
) -> None:
    """The renew example (acquire --export, two steps, release) holds the lock in both steps."""
    step(tmp_path / "migrate.sh", "deploy")
    step(tmp_path / "restart.sh", "deploy")
    result = run_example("renew", shell, tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "reached\n", "")
    assert (tmp_path / "migrate.sh.held").read_text() == "75\n"
    assert (tmp_path / "restart.sh.held").read_text() == "75\n"
    assert not held("deploy", shell)
