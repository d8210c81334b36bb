"""The command line: a thin click skin over `lockrun.runner.run`; the only place that exits."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
from typing import TYPE_CHECKING, Final, NoReturn, TypeVar

import click

from lockrun import __version__
from lockrun.bounds import MAX_SLOTS
from lockrun.errors import (
    ExitCode,
    Interrupted,
    LockBusy,
    LockrunError,
    OutputError,
    UsageError,
)
from lockrun.lock import DEFAULT_NAMESPACE, DEFAULT_TTL
from lockrun.runner import (
    DEFAULT_HOOK_MAX_TIME,
    DEFAULT_KILL_AFTER,
    DEFAULT_LOST_KILL_AFTER,
    Options,
    run,
    states_for_status,
)
from lockrun.timing import clock_time, format_duration, parse_duration
from lockrun.uri import DEFAULT_URI, HIDDEN, SCHEMES, redact, secrets_of

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from click.shell_completion import CompletionItem, ShellComplete

    from lockrun.backends import Holder, LockState

_Command = TypeVar("_Command", bound="Callable[..., object]")
_CONTEXT: Final = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# What a terminal would act on, or what would forge a line or a row: C0 and C1 controls
# (a line break in a name must not split the line cron mails), DEL, lone surrogates (not
# UTF-8: printing one would fail), bidirectional overrides and Unicode line separators.
_UNPRINTABLE: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)
_SECRETS: Final[list[str]] = []  # the lock URI's, never to be printed (`hide`)


def printable(text: str) -> str:
    """Escape every character of *text* that a terminal would act on (an ESC, a line break)."""
    return _UNPRINTABLE.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code <= _LATIN1 else f"\\u{code:04x}"


_LATIN1: Final = 0xFF


def hide(text: str) -> str:
    """Replace each secret of the lock URI in use with ``***``: the last line of defence."""
    for secret in _SECRETS:
        text = text.replace(secret, HIDDEN)
    return text


def _keep_secret(uri: str) -> None:
    """Make `hide` hide the passwords of *uri* (those too short to hide anywhere excepted).

    User names are hidden from URIs (`redact`) and from what servers say (`scrub`); in
    lockrun's own words a user name like root or lockrun is no secret.
    """
    passwords = secrets_of(uri).passwords
    _SECRETS[:] = [secret for secret in passwords if len(secret) >= _SHORTEST_HIDDEN]


_SHORTEST_HIDDEN: Final = 4  # a shorter secret would hide letters of every word


def say(line: str) -> None:
    """Write one ``lockrun: …`` line to stderr; stdout belongs to the command."""
    with _LIVE.lock:
        _LIVE.write(f"\r\x1b[K{_text(line)}\n{_LIVE.shown}" if _LIVE.shown else f"{_text(line)}\n")


def _text(line: str) -> str:
    return f"lockrun: {printable(hide(line))}"


class _LiveLine:
    """One line of stderr on a terminal that is redrawn in place; `say` writes above it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shown = ""

    def show(self, line: str) -> None:
        """Replace the live line with *line*, cut to the terminal's width ('' erases it).

        A line that wrapped could not be redrawn: a carriage return goes back to the
        start of its last row only.
        """
        with self.lock:
            try:
                width = os.get_terminal_size(sys.stderr.fileno()).columns or 80  # 0: unknown
            except (OSError, ValueError):
                width = 80
            self.shown = _text(line)[: width - 1] if line else ""
            self.write(f"\r\x1b[K{self.shown}")

    @staticmethod
    def write(text: str) -> None:
        if sys.stderr is None:  # started with fd 2 closed
            return
        with contextlib.suppress(OSError, ValueError):  # stderr closed: nobody is reading
            sys.stderr.write(text)
            sys.stderr.flush()


_LIVE: Final = _LiveLine()


def _on_terminal() -> bool:
    """Return whether stderr is a terminal that can redraw a line, and we are in front.

    A background job (`lockrun -v … &`) would redraw over the shell's prompt every second.
    """
    if not sys.stderr.isatty() or os.environ.get("TERM", "dumb") == "dumb":
        return False
    try:
        return os.tcgetpgrp(sys.stderr.fileno()) == os.getpgrp()
    except OSError:  # a terminal we are not attached to
        return False


class Duration(click.ParamType):  # type: ignore[type-arg]  # click 8.4 made it generic
    """A DURATION: ``90``, ``1.5``, ``90s``, ``15m``, ``2h``, ``1d``, maybe ``forever``."""

    name = "duration"

    def __init__(self, *, allow_forever: bool = False) -> None:
        """Accept ``forever`` (as None) only where it means something."""
        self.allow_forever = allow_forever

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float | None:
        """Parse *value*; a bad one is a usage error (64)."""
        try:
            return parse_duration(str(value), allow_forever=self.allow_forever)
        except UsageError as err:
            self.fail(str(err), param, ctx)

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        """Offer ``forever`` where it is allowed."""
        del ctx, param
        wanted = self.allow_forever and "forever".startswith(incomplete)
        return _offer({"forever": "wait as long as it takes"} if wanted else {})


# What Tab offers for --uri: each scheme as it starts.
URI_STARTS: Final = {
    start: what for kind in SCHEMES.values() for start, what in kind.starts.items()
}


def _offer(values: dict[str, str | None], kind: str = "plain") -> list[CompletionItem]:
    """Return completion items for *values* (value: help), importing click's module now."""
    from click.shell_completion import CompletionItem  # noqa: PLC0415 - only Tab pays for it

    return [CompletionItem(value, type=kind, help=what) for value, what in values.items()]


def _complete_uri(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    del ctx, param
    return _offer(
        {start: what for start, what in URI_STARTS.items() if start.startswith(incomplete)}
    )


def _complete_command(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    del param
    if ctx.params.get("command") or "/" in incomplete:  # the command's arguments, or a path
        return _offer({incomplete: None}, "file")
    found: set[str] = set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        with contextlib.suppress(OSError):
            found.update(
                entry.name
                for entry in os.scandir(directory or ".")
                if entry.name.startswith(incomplete)
                and not entry.is_dir()
                and os.access(entry.path, os.X_OK)
            )
    return _offer(dict.fromkeys(sorted(found)))


def _uri_option(what: str) -> Callable[[_Command], _Command]:
    """Return the ``-u/--uri`` option both commands take, explained as *what*."""
    return click.option(
        "-u",
        "--uri",
        metavar="URI",
        default=DEFAULT_URI,
        show_default=True,
        shell_complete=_complete_uri,
        help=what,
    )


_namespace_option: Final = click.option(  # each use makes an option of its own
    "--namespace",
    metavar="NS",
    default=DEFAULT_NAMESPACE,
    show_default=True,
    help="Partition of the lock names.",
)


@click.command(
    context_settings=_CONTEXT | {"allow_interspersed_args": False},
    epilog="Exit status: the command's own; 128+N if killed by signal N; 64 usage; "
    "69 backend unavailable; 70 internal error; 74 status could not write; 75 busy (-E); "
    "76 lock lost; 78 configuration; 79 taken over; 124 --max-time; "
    "126/127 cannot execute / not found; "
    "129/130/131/143 interrupted (HUP/INT/QUIT/TERM) while waiting. "
    "`lockrun status --help` shows who holds a lock.",
)
@click.option(
    "-n",
    "--name",
    metavar="NAME",
    allow_from_autoenv=False,  # LOCKRUN_NAME is what a command is told, not a setting
    help="Lock name, up to 255 bytes of UTF-8.  [default: the command's basename plus a hash]",
)
@_uri_option(f"Lock service: {', '.join(kind.usage for kind in SCHEMES.values())}.")
@click.option(
    "-s",
    "--slots",
    type=click.IntRange(1, MAX_SLOTS),
    default=1,
    show_default=True,
    allow_from_autoenv=False,  # LOCKRUN_SLOTS is what a command is told, not a setting
    help="Semaphore: at most N holders at once.",
)
@click.option(
    "-w",
    "--wait",
    type=Duration(allow_forever=True),
    default="0",
    show_default=True,
    help="How long to wait for the lock: 0 tries once, 'forever' waits; at most 366d.",
)
@click.option(
    "--ttl",
    type=Duration(),
    default=format_duration(DEFAULT_TTL),
    show_default=True,
    help="Lease length for lease-based backends, 1s to 1d; renewed every ttl/3.",
)
@click.option(
    "--max-time",
    type=Duration(),
    default=None,
    help="Stop the command after this long, at most 366d (TERM, --kill-after, KILL; exit 124).",
)
@click.option(
    "--kill-after",
    type=Duration(),
    default=format_duration(DEFAULT_KILL_AFTER),
    show_default=True,
    help="Grace between TERM and KILL when stopping the command; at most 1d.",
)
@click.option(
    "--lost-kill-after",
    type=Duration(),
    default=format_duration(DEFAULT_LOST_KILL_AFTER),
    show_default=True,
    help="That grace once the lock is known lost (someone may hold it); capped by --kill-after.",
)
@click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    default=int(ExitCode.BUSY),
    show_default=True,
    help="Exit status when the lock is busy or the wait expired.",
)
@click.option(
    "--shared/--exclusive",
    default=False,
    show_default=True,
    allow_from_autoenv=False,  # per lock, like --slots: a nested lockrun must not inherit it
    help="Share the lock with other --shared holders (readers); --exclusive waits for all.",
)
@click.option(
    "--hold-at-least",
    type=Duration(),
    default=None,
    allow_from_autoenv=False,
    help="Keep the lock taken until this long after the grant, even once the command ended.",
)
@click.option(
    "--take-over",
    is_flag=True,
    allow_from_autoenv=False,
    help="Ask the current holders to stop (they exit 79), then run; needs a --wait.",
)
@_namespace_option
@click.option("--close", is_flag=True, help="file: do not pass the lock fd to the command.")
@click.option(
    "--on-busy",
    metavar="CMD",
    allow_from_autoenv=False,  # one job's monitor: a nested lockrun must not inherit it
    help="Run CMD (/bin/sh -c) when the lock stayed busy; LOCKRUN_STATUS and more in its env.",
)
@click.option(
    "--on-exit",
    metavar="CMD",
    allow_from_autoenv=False,
    help="Run CMD (/bin/sh -c) after a run that got the lock, once the lock is released.",
)
@click.option(
    "--hook-max-time",
    type=Duration(),
    default=f"{DEFAULT_HOOK_MAX_TIME:g}s",
    show_default=True,
    help="Stop a hook still running after this long (TERM to its group, KILL 1s later).",
)
@click.option(
    "--metrics-file",
    metavar="PATH",
    help="Record each run in this Prometheus text file (node_exporter's textfile collector).",
)
@click.option("-q", "--quiet", is_flag=True, help="Say nothing when the lock is busy.")
@click.option("-v", "--verbose", is_flag=True, help="Report waiting, acquiring and releasing.")
@click.version_option(
    __version__,
    "-V",
    "--version",
    prog_name="lockrun",
    allow_from_autoenv=False,  # LOCKRUN_VERSION=1 must not turn every run into a version
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, shell_complete=_complete_command)
def run_command(
    command: tuple[str, ...],
    name: str | None,
    uri: str,
    slots: int,
    wait: float | None,
    ttl: float,
    max_time: float | None,
    kill_after: float,
    lost_kill_after: float,
    conflict_exit_code: int,
    shared: bool,
    hold_at_least: float | None,
    take_over: bool,
    namespace: str,
    close: bool,
    on_busy: str | None,
    on_exit: str | None,
    hook_max_time: float,
    metrics_file: str | None,
    quiet: bool,
    verbose: bool,
) -> int:
    """Run COMMAND while holding a named lock (or one of N semaphore slots).

    lockrun [OPTIONS] [--] COMMAND [ARG]...
    """
    _keep_secret(uri)
    if not command:
        msg = "no command to run: lockrun [OPTIONS] [--] COMMAND [ARG]..."
        raise click.UsageError(msg)
    options = Options(
        name,
        uri,
        slots,
        wait,
        ttl,
        max_time,
        kill_after,
        namespace,
        close,
        verbose,
        lost_kill_after,
        shared,
        hold_at_least or 0.0,
        take_over,
        conflict_exit_code=conflict_exit_code,
        on_busy=on_busy,
        on_exit=on_exit,
        hook_max_time=hook_max_time,
        metrics_file=metrics_file,
    )
    live = _LIVE.show if verbose and _on_terminal() else None
    try:
        return run(command, options, log=say, live=live)
    except LockBusy as err:
        if not quiet:
            say(str(err))
        return conflict_exit_code


@click.command(context_settings=_CONTEXT)
@_uri_option("Lock service to ask, as for running a command.")
@_namespace_option
@click.option(
    "--json", "as_json", is_flag=True, envvar="LOCKRUN_JSON", help="Print JSON for machines."
)
@click.argument("name", required=False)
def status_command(uri: str, namespace: str, as_json: bool, name: str | None) -> int:
    """Show who holds NAME (or every held lock) and who waits for it."""
    _keep_secret(uri)
    states = states_for_status(uri, namespace, name)
    if as_json:
        import json  # noqa: PLC0415 - kept off the start-up path of the run command

        _print(json.dumps([state.to_dict() for state in states], indent=2))
    elif not states:
        _print(printable(f"no locks held or awaited in namespace {namespace} at {redact(uri)}"))
    else:
        _print(_table(states))
    return 0


def _print(text: str) -> None:
    """Print *text* (escaped by the caller) on stdout, with no secret; `OutputError` if not."""
    if sys.stdout is None:  # started with fd 1 closed
        msg = "cannot write to stdout: it is closed"
        raise OutputError(msg)
    try:
        sys.stdout.write(hide(text) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError) as err:
        msg = f"cannot write to stdout: {getattr(err, 'strerror', None) or err}"
        raise OutputError(msg) from None


def _role(role: str, person: Holder) -> str:
    """Say what *person* does: ``holding``, ``waiting``, ``sharing``, ``held until 12:03:04``."""
    if person.until is not None:
        return f"held until {clock_time(person.until)}"
    if person.shared:
        return "sharing" if role == "holding" else "waiting (shared)"
    return role


def _table(states: Sequence[LockState]) -> str:
    rows = [("NAME", "SLOT", "STATE", "PID", "USER", "HOST", "SINCE", "COMMAND")]
    for state in states:
        if not state.holders and not state.waiters:
            rows.append((state.name, "-", "free", "", "", "", "", state.where))
        for role, people in (("holding", state.holders), ("waiting", state.waiters)):
            rows.extend(
                (
                    state.name,
                    "-" if person.slot is None else str(person.slot),
                    _role(role, person),
                    str(person.pid),
                    person.user,
                    person.host,
                    "" if person.since is None else clock_time(person.since),
                    " ".join(person.argv),
                )
                for person in people
            )
    # Escaped first, so that a cell's width is what the terminal shows.
    shown = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in shown) for column in range(len(shown[0]) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]])
        for row in shown
    )


def main(args: Sequence[str] | None = None) -> NoReturn:
    """Run the CLI and exit with the status of docs/semantics.md "Exit status"."""
    _occupy_closed_standard_fds()
    if instruction := os.environ.get(COMPLETE_VAR):  # the completion scripts call us back
        _exit(_complete(instruction))
    args = list(sys.argv[1:] if args is None else args)
    command, prog = run_command, "lockrun"
    if args[:1] == ["status"]:  # `lockrun -- status` runs a command called status
        command, prog, args = status_command, "lockrun status", args[1:]
    _exit(_exit_status(command, prog, args))


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


def _complete(instruction: str) -> int:
    """Print a completion script (``bash_source``) or the completions Tab asked for.

    Click's machinery, with the dispatch to ``status`` that `main` does for a command line.
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
        items = [_offer({f"{option}=" + item.value: item.help}, item.type)[0] for item in items]
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
    if args[:1] == ["status"]:
        return type(completer)(status_command, {}, "lockrun status", COMPLETE_VAR).get_completions(
            args[1:], incomplete
        )
    context = run_command.make_context("lockrun", list(args), resilient_parsing=True)
    if context.params.get("command"):  # past the command word, every word is the command's
        return _offer({incomplete: None}, "file")
    items = completer.get_completions(args, incomplete)
    if not args and "status".startswith(incomplete):
        items[:0] = _offer({"status": "show who holds or waits for a lock"})
    return items


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


def _exit_status(command: click.Command, prog: str, args: list[str]) -> int:
    try:
        result = command.main(
            args, prog_name=prog, standalone_mode=False, auto_envvar_prefix="LOCKRUN"
        )
    except click.UsageError as err:  # click would exit 2 and pass for the command's 2
        say(f"{err.format_message()} (see '{prog} --help')")
        return ExitCode.USAGE
    except click.Abort:  # Ctrl-C outside a wait, e.g. while parsing
        return ExitCode.INTERRUPTED
    except Interrupted as err:
        say(str(err))
        return err.status
    except LockrunError as err:
        say(str(err))
        return err.exit_code
    except Exception as err:  # noqa: BLE001 - the one place a bug becomes status 70
        if os.environ.get("LOCKRUN_DEBUG") == "1":
            import traceback  # noqa: PLC0415 - only bugs pay for it

            traceback.print_exc()
        say(f"internal error: {type(err).__name__}: {err} (LOCKRUN_DEBUG=1 shows a traceback)")
        return ExitCode.SOFTWARE
    return int(result or 0)  # --help and --version return None
