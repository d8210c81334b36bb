"""What Tab offers: the completion scripts, and the answers to the questions they ask."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from lockrun.cli import COMPLETE_VAR, dispatch, first_word, grammar
from lockrun.cli.commands import SUBCOMMANDS, run_command
from lockrun.cli.output import say
from lockrun.cli.params import offer
from lockrun.errors import ExitCode

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem, ShellComplete


def complete(instruction: str) -> int:
    """Print a completion script (``bash_source``) or the completions Tab asked for.

    Click's machinery, with the dispatch to ``status`` that `lockrun.cli.main` does for a
    command line.
    """
    shells = _shells()
    shell, _, action = instruction.partition("_")
    if shell not in shells or action not in {"source", "complete"}:
        say(f"{COMPLETE_VAR}={instruction}: expected bash_source, zsh_source or fish_source")
        return ExitCode.USAGE
    completer = shells[shell](run_command, {}, "lockrun", COMPLETE_VAR)
    if action == "source":
        click.echo(completer.source(), nl=False)
        return 0
    try:
        args, incomplete = completer.get_completion_args()
    except (KeyError, ValueError):  # run by hand, not by the completion script
        say(f"{COMPLETE_VAR}={instruction}: COMP_WORDS and COMP_CWORD come from the script")
        return ExitCode.USAGE
    items = _completions(completer, args, incomplete)
    option, equals, _ = incomplete.partition("=")
    if shell != "bash" and equals and option.startswith("-"):
        # zsh and fish replace the whole word: keep the `--uri=` of `--uri=red`.
        items = [offer({f"{option}=" + item.value: item.help}, item.type)[0] for item in items]
    for item in items:
        click.echo(completer.format_completion(item))
    return 0


def _shells() -> dict[str, type[ShellComplete]]:
    from click.shell_completion import (  # noqa: PLC0415 - only Tab pays for it
        BashComplete,
        FishComplete,
        ZshComplete,
        split_arg_string,
    )

    class Bash(BashComplete):
        """bash, which also splits words at ``:`` and ``=``: read the line itself."""

        typed = ""  # the value being completed, as lockrun sees it: `redis://h`
        word = ""  # the same, as bash sees it: `//h` (after the colon)

        def source(self) -> str:
            plain = "COMPREPLY+=($value)"
            nospace = "[[ $value == *[:/] ]] && compopt -o nospace"  # the host comes next
            words = 'COMP_WORDS="${COMP_WORDS[*]}"'
            line = 'COMP_LINE="${COMP_LINE:0:COMP_POINT}" COMP_WORD="${COMP_WORDS[COMP_CWORD]}"'
            script = super().source().replace(plain, f"{plain}\n            {nospace}")
            return script.replace(words, f"{words} {line}")

        def get_completion_args(self) -> tuple[list[str], str]:
            line = os.environ.get("COMP_LINE")
            if line is None:  # a script from before COMP_LINE
                return super().get_completion_args()
            words = split_arg_string(line)
            args, incomplete = words[1:], ""
            if line and not line[-1].isspace() and len(words) > 1:
                args, incomplete = words[1:-1], words[-1]
            option, equals, value = incomplete.partition("=")
            self.typed = value if equals and option.startswith("-") else incomplete
            self.word = os.environ.get("COMP_WORD", self.typed)
            return args, incomplete

        def format_completion(self, item: CompletionItem) -> str:
            # bash replaces only its own last word: drop what comes before it.
            cut = len(self.typed) - len(self.word)
            value = item.value
            if item.type == "plain" and cut > 0 and self.typed.endswith(self.word):
                value = value[cut:] if value.startswith(self.typed[:cut]) else value
            return f"{item.type},{value}"

    return {"bash": Bash, "zsh": ZshComplete, "fish": FishComplete}


def _completions(
    completer: ShellComplete, args: list[str], incomplete: str
) -> list[CompletionItem]:
    try:
        command, prog, args = dispatch(args)
    except click.UsageError:  # a subcommand after options it does not take: nothing fits
        return []
    if command is not run_command:
        return type(completer)(command, {}, prog, COMPLETE_VAR).get_completions(args, incomplete)
    context = run_command.make_context("lockrun", list(args), resilient_parsing=True)
    if context.params.get("command"):  # past the command word, every word is the command's
        return offer({incomplete: None}, "file")
    items = completer.get_completions(args, incomplete)
    word, given = first_word([*args, "word"])
    if word == len(args) and not incomplete.startswith("-"):
        # Where the command word goes: a subcommand that takes the options given fits too.
        items[:0] = offer(
            {
                word: what
                for word, (subcommand, what) in SUBCOMMANDS.items()
                if word.startswith(incomplete) and set(given) <= grammar(subcommand).keys()
            }
        )
    return items
