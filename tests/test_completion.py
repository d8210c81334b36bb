"""Shell completion: the committed scripts are current, and Tab completes in real shells."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lockrun.cli.params import URI_STARTS
from lockrun.uri import SCHEMES
from tests.support.cli import lockrun
from tests.support.servers import installed
from tests.support.terminal import Terminal, press_tab

ROOT = Path(__file__).parent.parent
SCRIPTS = {"bash": "lockrun.bash", "zsh": "_lockrun", "fish": "lockrun.fish"}
BIN = str(Path(sys.executable).parent)  # where this venv's `lockrun` is


def complete(line: str, shell: str = "bash") -> list[str]:
    """Return what lockrun offers for the end of *line*, asked as *shell*'s script asks."""
    words = line.split(" ")
    env = {**os.environ, "_LOCKRUN_COMPLETE": f"{shell}_complete", "COMP_WORDS": line}
    if shell == "bash":  # bash also breaks words at = and :, and passes the line itself
        word = re.search(r"([^\s=:]+|[=:]+)$", line)  # its last word, as bash splits
        env |= {"COMP_LINE": line, "COMP_WORD": word[1] if word else ""}
    env["COMP_CWORD"] = words[-1] if shell == "fish" else str(len(words) - 1)
    result = lockrun(env=env)
    assert (result.returncode, result.stderr) == (0, "")
    return result.stdout.splitlines()


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_committed_script_is_what_lockrun_generates(name: str) -> None:
    """completions/ holds exactly what `_LOCKRUN_COMPLETE=<shell>_source` prints."""
    result = lockrun(env={**os.environ, "_LOCKRUN_COMPLETE": f"{name}_source"})
    assert result.returncode == 0, result.stderr
    committed = (ROOT / "completions" / SCRIPTS[name]).read_text()
    assert result.stdout == committed, "run scripts/completions and commit the result"


def test_an_unknown_shell_is_a_usage_error() -> None:
    """An instruction for a shell lockrun has no script for exits 64 with one line."""
    result = lockrun(env={**os.environ, "_LOCKRUN_COMPLETE": "tcsh_source"})
    assert result.returncode == 64
    assert result.stdout == ""
    assert result.stderr == (
        "lockrun: _LOCKRUN_COMPLETE=tcsh_source: expected bash_source, zsh_source or fish_source\n"
    )


def test_completing_without_the_scripts_variables_is_a_usage_error() -> None:
    """`_LOCKRUN_COMPLETE=bash_complete` without COMP_WORDS exits 64 with one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMP_")}
    result = lockrun(env={**env, "_LOCKRUN_COMPLETE": "bash_complete"})
    assert (result.returncode, result.stdout) == (64, "")
    assert result.stderr == (
        "lockrun: _LOCKRUN_COMPLETE=bash_complete: COMP_WORDS and COMP_CWORD come from the script\n"
    )


def test_option_names_complete() -> None:
    """`lockrun --ur` offers --uri; `lockrun --` offers every long option not yet given."""
    assert complete("lockrun --ur") == ["plain,--uri", "plain,--uri-file"]
    assert complete("lockrun status --uri-file /etc/lockrun-") == ["file,/etc/lockrun-"]
    offered = complete("lockrun --wait 5 --")
    assert "plain,--name" in offered
    assert "plain,--slots" in offered
    assert "plain,--wait" not in offered


def test_every_scheme_is_offered_for_uri() -> None:
    """`--uri <Tab>` offers a start for every scheme lockrun knows, and nothing else."""
    offered = [line.removeprefix("plain,") for line in complete("lockrun --uri ")]
    assert offered == list(URI_STARTS)
    assert {start.split(":")[0] for start in offered} == set(SCHEMES)
    assert complete("lockrun -u postg") == ["plain,postgresql://", "plain,postgres://"]
    assert complete("lockrun status --uri red") == [
        "plain,redis://",
        "plain,rediss://",
        "plain,redis+sentinel://",
        "plain,redis+cluster://",
        "plain,rediss+cluster://",
    ]


def test_words_after_a_uri_complete_in_bash() -> None:
    """In bash, which splits `redis://h` at the colon, the words after a URI complete."""
    assert complete("lockrun --uri redis://h/0 --wa") == ["plain,--wait"]
    assert "plain,echo" in complete("lockrun --uri redis://h/0 -- ech")
    assert complete("lockrun --uri redis:") == ["plain,://"]  # bash's word is ":"
    assert complete("lockrun --uri=postgresq") == ["plain,postgresql://"]  # and here "postgresq"


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_an_option_joined_by_equals_keeps_its_name(shell: str) -> None:
    """For zsh and fish, which replace all of `--uri=red`, each offer starts with `--uri=`."""
    offered = [line for line in complete("lockrun --uri=redis+", shell) if "sentinel" in line]
    assert len(offered) == 1
    assert "--uri=redis+sentinel" in offered[0]


def test_wait_offers_forever() -> None:
    """`--wait f` completes to forever; --ttl, which has no forever, offers nothing."""
    assert complete("lockrun --wait f") == ["plain,forever"]
    assert complete("lockrun --ttl f") == []


def test_status_completes_as_the_first_word_only() -> None:
    """`lockrun stat` offers status first; after an option it would be a command's name."""
    assert complete("lockrun statu")[0] == "plain,status"
    assert "plain,status" not in complete("lockrun -v statu")


def test_status_options_complete() -> None:
    """`lockrun status --` offers the status subcommand's own options."""
    assert complete("lockrun status --") == [
        "plain,--uri",
        "plain,--uri-file",
        "plain,--namespace",
        "plain,--json",
        "plain,--check",
        "plain,--quiet",
        "plain,--help",
    ]


def test_the_command_word_completes_from_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first word of the command is a program on PATH; the words after it are files."""
    program = tmp_path / "lockrun-test-program"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    (tmp_path / "lockrun-test-data").write_text("not executable\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert complete("lockrun -n x -- lockrun-test-") == ["plain,lockrun-test-program"]
    assert complete("lockrun lockrun-test-") == ["plain,lockrun-test-program"]
    assert complete("lockrun -n x lockrun-test-program --ur") == ["file,--ur"]
    assert complete("lockrun ./lockrun-te") == ["file,./lockrun-te"]


def completion_env(home: Path) -> dict[str, str]:
    """Return an environment for an interactive shell that finds this venv's lockrun."""
    return {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "LANG": "C.UTF-8"}


def test_bash_tab_completes_an_option_name(tmp_path: Path) -> None:
    """In an interactive bash with the script sourced, `lockrun --uri-f<Tab>` becomes --uri-file."""
    bash = installed("bash")
    script = ROOT / "completions" / "lockrun.bash"
    with Terminal([bash, "--norc", "--noprofile", "-i"], env=completion_env(tmp_path)) as term:
        term.send(f"PS1='$ '; source {script}; echo sourced-$?\n".encode())
        term.read_until(b"sourced-0")
        term.send(b"lockrun --uri-f\t")
        term.read_until(b"lockrun --uri-file ")
        term.send(b"\x15lockrun --uri redis+s\t")
        shown = term.read_until(b"redis+sentinel://")
        term.send(b"h/0 --wa\t")  # after a URI, whose colon bash breaks words at
        term.read_until(b"--wait ")
        term.send(b"\x15lockrun --uri=redis+c\t")
        term.read_until(b"--uri=redis+cluster://")
        term.send(b"X\n")  # no space after the scheme: the host follows at once
        term.read_until(b"lockrun: no command to run")
        assert b"--uri redis+sentinel://" in shown


def test_zsh_tab_completes_an_option_name(tmp_path: Path) -> None:
    """In an interactive zsh with the script on fpath, `lockrun --uri-f<Tab>` completes."""
    setup = f"fpath=({ROOT / 'completions'} $fpath); autoload -Uz compinit && compinit -u -D"
    press_tab(
        [installed("zsh"), "-f", "-i"],
        f"{setup}; echo ready-$?",
        "lockrun --uri-f",
        "lockrun --uri-file",  # zsh draws its own suffix space, in bold
        env=completion_env(tmp_path),
    )


def test_fish_completes_option_names_schemes_and_status() -> None:
    """fish, given the script, completes --uri-f, a scheme and status (`complete -C`)."""
    fish = installed("fish")
    script = ROOT / "completions" / "lockrun.fish"
    queries = ["lockrun --uri-f", "lockrun --uri mari", "lockrun statu"]
    commands = f"source {script}; " + "; ".join(f"complete -C '{query}'" for query in queries)
    result = subprocess.run(
        [fish, "--no-config", "-c", commands],
        env=completion_env(Path.home()),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    offered = [line.split("\t")[0] for line in result.stdout.splitlines()]
    assert offered[:2] == ["--uri-file", "mariadb://"]
    assert "status" in offered[2:]
