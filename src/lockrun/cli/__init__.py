"""The command line: a thin click skin over `lockrun.runner.run`; the only place that exits.

Here are `main`, the dispatch to a subcommand and the exit status; the commands are in
`lockrun.cli.commands` and `lockrun.cli.tokens`, their options in `lockrun.cli.params`, what
they write in `lockrun.cli.output`, and what Tab offers in `lockrun.cli.completion`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import TYPE_CHECKING, Final, NoReturn

import click

from lockrun.backends import flockwait
from lockrun.cli.commands import SUBCOMMANDS, run_command
from lockrun.cli.output import say
from lockrun.cli.params import HELP
from lockrun.errors import ExitCode, LockrunError, OutOfFiles, out_of_files

if TYPE_CHECKING:
    from collections.abc import Sequence

# The commands `dispatch` chooses among are named here too: tests/test_man.py and the
# other tests read them from the package.
__all__ = [
    "COMPLETE_VAR",
    "SUBCOMMANDS",
    "dispatch",
    "first_word",
    "grammar",
    "main",
    "run_command",
]


def main(args: Sequence[str] | None = None) -> NoReturn:
    """Run the CLI and exit with the status of docs/semantics.md "Exit status"."""
    _occupy_closed_standard_fds()
    flockwait.claim_signals()  # our process: a timed flock(2) may use ITIMER_REAL (A1)
    if instruction := os.environ.get(COMPLETE_VAR):  # the completion scripts call us back
        from lockrun.cli import completion  # noqa: PLC0415 - only Tab pays for it

        _exit(completion.complete(instruction))
    args = list(sys.argv[1:] if args is None else args)
    try:
        command, prog, args = dispatch(args)
    except click.UsageError as err:
        say(err.format_message())
        _exit(ExitCode.USAGE)
    _exit(_exit_status(command, prog, args))


def dispatch(args: list[str]) -> tuple[click.Command, str, list[str]]:
    """Return the command *args* are for, its name for messages, and its arguments.

    A subcommand word is that subcommand, also after options (as in git or docker: #29),
    which move behind it when it takes them all; else a usage error. `lockrun … -- status`
    runs a program called status (docs/semantics.md "Options").
    """
    word, given = first_word(args)
    if word is None or args[word] not in SUBCOMMANDS:
        return run_command, "lockrun", args
    subcommand = args[word]
    command = SUBCOMMANDS[subcommand][0]
    taken = grammar(command)
    for option in given:
        if option not in taken:
            msg = (
                f"'{subcommand}' is a subcommand and takes no {option}: put the subcommand "
                f"first (lockrun {subcommand} [OPTIONS] …), or write 'lockrun [OPTIONS] -- "
                f"{subcommand} …' to run a program called {subcommand}"
            )
            raise click.UsageError(msg)
    return command, f"lockrun {subcommand}", args[:word] + args[word + 1 :]


def grammar(command: click.Command) -> dict[str, bool]:
    """Map each spelling of *command*'s options (``-u``, ``--uri``) to whether it takes a value."""
    spellings: dict[str, bool] = dict.fromkeys(HELP, False)
    for param in command.params:
        if isinstance(param, click.Option):
            takes = not param.is_flag and not param.count
            spellings.update(dict.fromkeys([*param.opts, *param.secondary_opts], takes))
    return spellings


def first_word(args: list[str]) -> tuple[int | None, list[str]]:
    """Return where the first word that is no option nor an option's value is, and the options.

    As click reads options: ``--uri=X``, ``--uri X``, ``-uX``, ``-u X``, ``-qv``; a value is
    taken by the spelling of any command that knows it. None after ``--``, or with no word.
    """
    values = {
        spelling
        for command in (run_command, *(each for each, _ in SUBCOMMANDS.values()))
        for spelling, takes in grammar(command).items()
        if takes
    }
    given: list[str] = []
    at = 0
    while at < len(args):
        arg = args[at]
        if arg == "--":
            return None, given
        if not arg.startswith("-") or arg == "-":
            return at, given
        at += 1
        if arg.startswith("--"):
            option = arg.partition("=")[0]
            given.append(option)
            at += option == arg and option in values
            continue
        for letter, short in enumerate(f"-{each}" for each in arg[1:]):
            given.append(short)
            if short in values:  # the rest of the word is its value, else the next word is
                at += letter == len(arg) - 2
                break
    return None, given


def _occupy_closed_standard_fds() -> None:
    """Put /dev/null, close-on-exec, on any of fds 0, 1 and 2 that we were started without.

    Otherwise the next file or socket opened would land there: a lock file or a server's
    socket taken for stdout. Close-on-exec: the command still starts with them closed.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)  # the lowest free fd: this one


COMPLETE_VAR: Final = "_LOCKRUN_COMPLETE"


def _exit(status: int) -> NoReturn:
    """Exit with *status*, skipping the teardown of every module the driver imported.

    Tearing down redis-py's (and asyncio's) modules costs ~25 ms of CPU per run, which a
    queue of waiters pays one after the other. Exit handlers still run, then the streams
    are flushed; everything lockrun holds was released before this point.
    """
    atexit._run_exitfuncs()  # noqa: SLF001 - what interpreter shutdown would call first
    for stream in (sys.stdout, sys.stderr):  # pragma: no cover - coverage saved its data
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None
            stream.flush()
    os._exit(status)  # pragma: no cover


# Fewer than lockrun's own descriptors (the lock's, the guardian's switch, the watch's
# pipes, a server's sockets: 9 to 13 of them) failed anywhere inside it, an import included.
MIN_OPEN_FILES: Final = 16


def _check_open_files() -> None:
    """Raise `OutOfFiles` for a `ulimit -n` too small for lockrun to run at all."""
    limit = os.sysconf("SC_OPEN_MAX")  # the soft RLIMIT_NOFILE; -1 if unlimited
    if 0 <= limit < MIN_OPEN_FILES:
        msg = f"ulimit -n {limit} is too small for lockrun: it needs {MIN_OPEN_FILES} open files"
        raise OutOfFiles(msg)


def spelled_long(command: click.Command, args: list[str]) -> list[str]:
    """Return *args* with each option of *command* written ``-x`` alone spelled ``--long``.

    The same option to click, which looks every option word up as a long option first:
    for ``-n`` that miss builds a did-you-mean suggestion, which imports difflib and
    gettext's locale, about 4 ms of a run's start-up (issue #32). A ``-x`` whose value is
    missing stays (click's message names the spelling given), as does every other form
    (``-nNAME``, ``-qv``); nothing after the options is touched.
    """
    takes = grammar(command)
    short, long = HELP
    longs = {short: long}
    for param in command.params:
        if isinstance(param, click.Option) and (
            long := next((each for each in param.opts if each.startswith("--")), "")
        ):
            longs |= {each: long for each in param.opts if len(each) == 2}  # noqa: PLR2004
    spelled = list(args)
    at = 0
    while at < len(spelled):
        word = spelled[at]
        if word == "--" or not word.startswith("-") or word == "-":
            break
        at += 1
        if word.startswith("--"):
            at += word in takes and takes[word]  # --uri X; not --uri=X
        elif word in longs and (not takes[word] or at < len(spelled)):
            spelled[at - 1] = longs[word]
            at += takes[word]
        else:  # -qv, -nNAME, or a -n with no value: as click reads them
            for letter, short in enumerate(f"-{each}" for each in word[1:]):
                if takes.get(short, False):
                    at += letter == len(word) - 2
                    break
    return spelled


def _exit_status(command: click.Command, prog: str, args: list[str]) -> int:
    try:
        _check_open_files()
        result = command.main(
            spelled_long(command, args),
            prog_name=prog,
            standalone_mode=False,
            auto_envvar_prefix="LOCKRUN",
        )
    except click.UsageError as err:  # click would exit 2 and pass for the command's 2
        say(f"{err.format_message()} (see '{prog} --help')")
        return ExitCode.USAGE
    except click.Abort:  # Ctrl-C outside a wait, e.g. while parsing
        return ExitCode.INTERRUPTED
    except LockrunError as err:
        say(str(err))
        return err.exit_code
    except Exception as err:  # noqa: BLE001 - the one place a bug becomes status 70
        return _unforeseen(err)
    return int(result or 0)  # --help and --version return None


def _unforeseen(err: Exception) -> int:
    """Say *err*, which no part of lockrun handled, and return 71 or 70 (a bug)."""
    if out_of_files(err):  # an input (ulimit -n), not a bug; the finally blocks ran
        say(f"out of open files ({err}); raise ulimit -n")
        return ExitCode.OSERR
    if os.environ.get("LOCKRUN_DEBUG") == "1":
        import traceback  # noqa: PLC0415 - only bugs pay for it

        traceback.print_exc()
    say(f"internal error: {type(err).__name__}: {err} (LOCKRUN_DEBUG=1 shows a traceback)")
    return ExitCode.SOFTWARE
