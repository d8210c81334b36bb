"""The command line: a thin click skin over `lockrun.runner.run`; the only place that exits."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import sys
import threading
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar, cast

import click

from lockrun import __version__
from lockrun.backends import flockwait, parse_uri
from lockrun.bounds import MAX_SLOTS
from lockrun.errors import (
    ExitCode,
    LockBusy,
    LockrunError,
    OutOfFiles,
    OutputError,
    UsageError,
    out_of_files,
)
from lockrun.lock import DEFAULT_NAMESPACE, describe
from lockrun.runner import (
    DEFAULT_HOOK_MAX_TIME,
    DEFAULT_KILL_AFTER,
    DEFAULT_LOST_KILL_AFTER,
    Options,
    run,
    states_for_status,
)
from lockrun.timing import DEFAULT_TTL, clock_time, format_duration, parse_duration
from lockrun.uri import HIDDEN, SCHEMES, redact, secrets_of
from lockrun.urifile import choose_uri

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from click.shell_completion import CompletionItem, ShellComplete

    from lockrun.backends import Holder, LockState

_Command = TypeVar("_Command", bound="Callable[..., object]")
_HELP: Final = ("-h", "--help")
# 80 columns: --help lays out the same on every terminal, one line an option where it can.
_CONTEXT: Final = {"help_option_names": list(_HELP), "max_content_width": 80}


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
    """A DURATION: ``90``, ``1.5``, ``500ms``, ``15m``, ``1h30m``, maybe ``forever``."""

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
            self.fail(f"{err}{_from_environment(param, ctx)}", param, ctx)

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        """Offer ``forever`` where it is allowed."""
        del ctx, param
        wanted = self.allow_forever and "forever".startswith(incomplete)
        return _offer({"forever": "wait as long as it takes"} if wanted else {})


def _from_environment(param: click.Parameter | None, ctx: click.Context | None) -> str:
    """Return `` (from LOCKRUN_X)`` if *param*'s value came from there, else ''."""
    if param is None or ctx is None or param.name is None:
        return ""
    if ctx.get_parameter_source(param.name) is not click.core.ParameterSource.ENVIRONMENT:
        return ""
    return f" (from {ctx.auto_envvar_prefix}_{param.name.upper()})"


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


def _complete_file(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    del ctx, param
    return _offer({incomplete: None}, "file")


def _complete_command(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    del param
    if ctx.params.get("command") or "/" in incomplete:  # the command's arguments, or a path
        return _offer({incomplete: None}, "file")
    found: set[str] = set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        # Closed however the scan ends: an error mid-way left the directory open (a
        # ResourceWarning under the tests' filterwarnings = error).
        with contextlib.suppress(OSError), os.scandir(directory or ".") as entries:
            found.update(
                entry.name
                for entry in entries
                if entry.name.startswith(incomplete)
                and not entry.is_dir()
                and os.access(entry.path, os.X_OK)
            )
    return _offer(dict.fromkeys(sorted(found)))


class _Grouped(click.Command):
    """A command whose --help lists its options under headings, one line each where it can.

    *groups* names each heading's options in order (tests/test_help.py checks that each
    option is under exactly one); *subcommands* lists `SUBCOMMANDS` first, as git does.
    """

    def __init__(
        self,
        *args: Any,  # noqa: ANN401 - click.Command's own, passed on as they are
        groups: Sequence[tuple[str, Sequence[str]]],
        subcommands: bool = False,
        **kwargs: Any,  # noqa: ANN401
    ) -> None:
        """Make the command, with its --help laid out as *groups* says."""
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.subcommands = subcommands

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        """Return click's -h/--help, with a help line in the style of the others."""
        option = super().get_help_option(ctx)
        if option is not None:
            option.help = "show this help and exit"
        return option

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the usage line, and the subcommands' under it."""
        super().format_usage(ctx, formatter)
        if self.subcommands:
            formatter.write(f"{'':{formatter.current_indent}}       lockrun SUBCOMMAND [ARGS]...\n")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the subcommands, then each group of options under its heading."""
        if self.subcommands:
            with formatter.section("Subcommands (lockrun SUBCOMMAND --help)"):
                formatter.write_dl([(word, what) for word, (_, what) in SUBCOMMANDS.items()])
        shown = {  # click names its help option "help" or "_click_default_help" (8.2+)
            "help" if "--help" in param.opts else str(param.name): (record[0], param.help or "")
            for param in self.get_params(ctx)
            if isinstance(param, click.Option) and (record := param.get_help_record(ctx))
        }
        # One column for every group: the options line up from heading to heading.
        column = max(len(names) for names, _ in shown.values()) + 2
        for heading, names in self.groups:
            with formatter.section(heading):
                for name in names:
                    spelled, what = shown[name]
                    indent = formatter.current_indent
                    lines = click.wrap_text(what, max(formatter.width - indent - column, 20))
                    first, *rest = lines.splitlines() or [""]
                    formatter.write(f"{'':{indent}}{spelled:{column}}{first}\n")
                    formatter.write("".join(f"{'':{indent + column}}{line}\n" for line in rest))


_URI_HELP: Final = "where the lock lives: file: (default), redis:…"


def _uri_option(what: str, *, lazy: bool = False) -> Callable[[_Command], _Command]:
    """Return ``-u/--uri`` and ``--uri-file``, which every command takes; *what* is --uri's help.

    The command gets one ``uri``: the first of --uri, --uri-file, LOCKRUN_URI,
    LOCKRUN_URI_FILE and systemd's credential that is given (`lockrun.urifile.choose_uri`).
    With *lazy*, a function that returns it: `release` of a keeper's token reads none.
    """

    def options(command: _Command) -> _Command:
        @functools.wraps(command)
        def chosen(
            *args: object, uri: str | None, uri_file: str | None, **kwargs: object
        ) -> object:
            choose = functools.partial(choose_uri, uri, uri_file, os.environ)
            return command(*args, uri=choose if lazy else choose(), **kwargs)

        uri_file = click.option(
            "--uri-file",
            metavar="PATH",
            allow_from_autoenv=False,  # LOCKRUN_URI_FILE: choose_uri reads it, in its turn
            shell_complete=_complete_file,
            help="read the URI from a file (no password in ps)",
        )
        uri = click.option(
            "-u",
            "--uri",
            metavar="URI",
            allow_from_autoenv=False,  # LOCKRUN_URI: choose_uri reads it, in its turn
            shell_complete=_complete_uri,
            help=what,
        )
        return cast("_Command", uri(uri_file(chosen)))

    return options


_namespace_option: Final = click.option(  # each use makes an option of its own
    "--namespace",
    metavar="NS",
    default=DEFAULT_NAMESPACE,
    help=f"a separate set of lock names (default: {DEFAULT_NAMESPACE})",
)


_slots_option: Final = click.option(
    "-s",
    "--slots",
    type=click.IntRange(1, MAX_SLOTS),
    metavar="N",
    default=1,
    allow_from_autoenv=False,  # LOCKRUN_SLOTS is what a command is told, not a setting
    help=f"semaphore: at most N holders at once (1 to {MAX_SLOTS})",
)
_wait_option: Final = click.option(
    "-w",
    "--wait",
    type=Duration(allow_forever=True),
    default="0",
    help="wait this long: 0 tries once (default), forever",
)
_ttl_option: Final = click.option(
    "--ttl",
    type=Duration(),
    default=format_duration(DEFAULT_TTL),
    help=f"lease length, renewed every ttl/3 (default {format_duration(DEFAULT_TTL)})",
)
_conflict_option: Final = click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    metavar="N",
    default=int(ExitCode.BUSY),
    help=f"exit status when the lock is busy (default {int(ExitCode.BUSY)})",
)
_shared_option: Final = click.option(
    "--shared/--exclusive",
    default=False,
    allow_from_autoenv=False,  # per lock, like --slots: a nested lockrun must not inherit it
    help="share the lock with other readers, or not",
)
_take_over_option: Final = click.option(
    "--take-over",
    is_flag=True,
    allow_from_autoenv=False,
    help="stop the holders (they exit 79), then take it",
)
_quiet_option: Final = click.option(
    "-q", "--quiet", is_flag=True, help="say nothing when the lock is busy"
)
_verbose_option: Final = click.option(
    "-v", "--verbose", is_flag=True, help="report waiting, acquiring and releasing"
)


_STATUS_OUTPUT: Final = ("as_json", "check", "quiet", "help")
_RUN_GROUPS: Final = (
    ("Locking", ("name", "uri", "uri_file", "namespace", "slots", "shared", "conflict_exit_code")),
    ("Waiting and time limits", ("wait", "ttl", "max_time", "kill_after", "lost_kill_after")),
    ("Modes", ("hold_at_least", "take_over", "close")),
    ("Monitoring", ("on_start", "on_exit", "on_busy", "hook_max_time", "metrics_file")),
    ("Output", ("quiet", "verbose", "version", "help")),
)


@click.command(
    cls=_Grouped,
    groups=_RUN_GROUPS,
    subcommands=True,
    context_settings=_CONTEXT | {"allow_interspersed_args": False},
    epilog="""\b
Example: run backup.sh, or wait up to 10 minutes for the run still going on
  lockrun --name backup --wait 10m -- ./backup.sh

Exit status: the command's own; 75 busy (-E); 76 lock lost; 79 taken over;
124 --max-time; 64 usage; 69 lock service unavailable; 78 configuration;
all of them in man lockrun. DURATION: 90, 1.5, 500ms, 1m30s, 2d12h.""",
)
@click.option(
    "-n",
    "--name",
    metavar="NAME",
    allow_from_autoenv=False,  # LOCKRUN_NAME is what a command is told, not a setting
    help="lock name (default: the command's, plus a hash)",
)
@_uri_option(_URI_HELP)
@_slots_option
@_wait_option
@_ttl_option
@click.option(
    "--max-time",
    type=Duration(),
    default=None,
    help="stop the command after this long (exit 124)",
)
@click.option(
    "--kill-after",
    type=Duration(),
    default=format_duration(DEFAULT_KILL_AFTER),
    help=f"grace from TERM to KILL (default {format_duration(DEFAULT_KILL_AFTER)})",
)
@click.option(
    "--lost-kill-after",
    type=Duration(),
    default=format_duration(DEFAULT_LOST_KILL_AFTER),
    help=f"that grace once the lock is lost (default {format_duration(DEFAULT_LOST_KILL_AFTER)})",
)
@_conflict_option
@_shared_option
@click.option(
    "--hold-at-least",
    type=Duration(),
    default=None,
    allow_from_autoenv=False,
    help="keep the lock taken this long after the grant",
)
@_take_over_option
@_namespace_option
@click.option("--close", is_flag=True, help="file: do not pass the lock fd to the command")
@click.option(
    "--on-start",
    metavar="CMD",
    allow_from_autoenv=False,  # one job's monitor: a nested lockrun must not inherit it
    help="run CMD (sh -c) beside the command as it starts",
)
@click.option(
    "--on-busy",
    metavar="CMD",
    allow_from_autoenv=False,  # one job's monitor: a nested lockrun must not inherit it
    help="run CMD (sh -c) after a run that found it busy",
)
@click.option(
    "--on-exit",
    metavar="CMD",
    allow_from_autoenv=False,
    help="run CMD (sh -c) after a run that got the lock",
)
@click.option(
    "--hook-max-time",
    type=Duration(),
    default=f"{DEFAULT_HOOK_MAX_TIME:g}s",
    help=f"stop a hook after this long (default {DEFAULT_HOOK_MAX_TIME:g}s)",
)
@click.option(
    "--metrics-file",
    metavar="PATH",
    help="record the runs in a Prometheus text file",
)
@_quiet_option
@_verbose_option
@click.version_option(
    __version__,
    "-V",
    "--version",
    prog_name="lockrun",
    allow_from_autoenv=False,  # LOCKRUN_VERSION=1 must not turn every run into a version
    help="show the version and exit",
)
@click.argument(
    "command",
    nargs=-1,
    type=click.UNPROCESSED,
    metavar="[--] COMMAND [ARG]...",
    shell_complete=_complete_command,
)
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
    on_start: str | None,
    on_busy: str | None,
    on_exit: str | None,
    hook_max_time: float,
    metrics_file: str | None,
    quiet: bool,
    verbose: bool,
) -> int:
    """Run COMMAND while holding a named lock (or one of N semaphore slots)."""
    _keep_secret(uri)
    if not command:
        msg = "no command to run: lockrun [OPTIONS] [--] COMMAND [ARG]..."
        raise click.UsageError(msg)
    options = Options(
        name=name,
        uri=uri,
        slots=slots,
        wait=wait,
        ttl=ttl,
        max_time=max_time,
        kill_after=kill_after,
        namespace=namespace,
        close=close,
        verbose=verbose,
        lost_kill_after=lost_kill_after,
        shared=shared,
        hold_at_least=hold_at_least or 0.0,
        take_over=take_over,
        conflict_exit_code=conflict_exit_code,
        on_start=on_start,
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


@click.command(
    cls=_Grouped,
    groups=(("Locking", ("uri", "uri_file", "namespace")), ("Output", _STATUS_OUTPUT)),
    context_settings=_CONTEXT,
    epilog="""\b
Example: in a script, skip a step while a backup is running
  lockrun status --check -q backup || exit 0

Exit status: 0; with --check, 0 if NAME is free and 75 if anyone holds it
(waiters alone do not count); 64 usage; 69 lock service unavailable; 74 could
not write; 78 configuration.""",
)
@_uri_option(_URI_HELP)
@_namespace_option
@click.option(
    "--json", "as_json", is_flag=True, envvar="LOCKRUN_JSON", help="print JSON for machines"
)
@click.option(
    "--check",
    is_flag=True,
    allow_from_autoenv=False,  # a status that fails must be asked for where it is run
    help="exit 75 if anyone holds NAME, else 0",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    allow_from_autoenv=False,  # LOCKRUN_QUIET is the run command's: it must not hide a status
    help="print nothing (with --check: the status answers)",
)
@click.argument("name", required=False)
def status_command(
    uri: str, namespace: str, as_json: bool, check: bool, quiet: bool, name: str | None
) -> int:
    """Show who holds NAME (or every held lock) and who waits for it."""
    _keep_secret(uri)
    if check and name is None:
        msg = "--check needs a NAME: lockrun status --check NAME"
        raise click.UsageError(msg)
    states = states_for_status(uri, namespace, name)
    if not quiet:
        _print(_shown(states, as_json=as_json, empty=f"{namespace} at {redact(uri)}"))
    holders = [holder for state in states for holder in state.holders]
    if not check or not holders:
        return 0
    if not quiet:
        say(f"{name} is held by {'; '.join(describe(holder) for holder in holders)}")
    return ExitCode.BUSY


def _shown(states: Sequence[LockState], *, as_json: bool, empty: str) -> str:
    """Return what `lockrun status` prints of *states*: JSON, a table, or that *empty* is."""
    if as_json:
        import json  # noqa: PLC0415 - kept off the start-up path of the run command

        return json.dumps([state.to_dict() for state in states], indent=2)
    if not states:
        return printable(f"no locks held or awaited in namespace {empty}")
    return _table(states)


TOKEN_VARIABLE: Final = "LOCKRUN_TOKEN"  # noqa: S105 - a variable's name, not a password


@click.command(
    cls=_Grouped,
    groups=(
        ("Locking", ("uri", "uri_file", "namespace", "slots", "shared", "conflict_exit_code")),
        ("Waiting and time limits", ("wait", "ttl", "max_time")),
        ("Holding", ("owner", "no_keeper", "hold_at_least", "take_over")),
        ("The token", ("export", "env_file", "var")),
        ("Output", ("quiet", "verbose", "help")),
    ),
    context_settings=_CONTEXT,
    epilog="""\b
Example: one lock over several steps of a script
  TOKEN=$(lockrun acquire --wait 5m deploy) || exit
  ./deploy.sh
  lockrun release "$TOKEN"

Exit status: 0 held; 75 busy (-E); 79 taken over while waiting; 64 usage; 69
lock service unavailable; 74 the token could not be written (released); 78
configuration; 128+N interrupted while waiting; all of them in man lockrun.
No --on-start or other hook: the script's own steps can ping a monitor.""",
)
@_uri_option(_URI_HELP)
@_slots_option
@_wait_option
@_ttl_option
@click.option(
    "--no-keeper",
    is_flag=True,
    allow_from_autoenv=False,
    help="no process: Redis keeps the lease for --ttl",
)
@click.option(
    "--max-time",
    type=Duration(),
    default=None,
    help="release after this long (renew restarts it)",
)
@click.option(
    "--owner",
    metavar="PID|none",
    allow_from_autoenv=False,  # per lock: an inherited one would outlive its process
    help="release when PID exits (default: our parent)",
)
@_conflict_option
@_shared_option
@click.option(
    "--hold-at-least",
    type=Duration(),
    default=None,
    allow_from_autoenv=False,
    help="keep the lock taken this long after the grant",
)
@_take_over_option
@_namespace_option
@click.option(
    "--export",
    is_flag=True,
    allow_from_autoenv=False,
    help="print export LOCKRUN_TOKEN=… for eval",
)
@click.option(
    "--env-file",
    metavar="FILE",
    allow_from_autoenv=False,
    help="append LOCKRUN_TOKEN=… to FILE ($GITHUB_ENV)",
)
@click.option(
    "--var",
    metavar="NAME",
    default=TOKEN_VARIABLE,
    allow_from_autoenv=False,
    help=f"the variable to set (default {TOKEN_VARIABLE})",
)
@_quiet_option
@_verbose_option
@click.argument("name")
def acquire_command(
    uri: str,
    slots: int,
    wait: float | None,
    ttl: float,
    no_keeper: bool,
    max_time: float | None,
    owner: str | None,
    conflict_exit_code: int,
    shared: bool,
    hold_at_least: float | None,
    take_over: bool,
    namespace: str,
    export: bool,
    env_file: str | None,
    var: str,
    quiet: bool,
    verbose: bool,
    name: str,
) -> int:
    """Take NAME's lock and keep it in a keeper process until `lockrun release`.

    Prints a token for `lockrun release` and `lockrun renew`. The keeper also releases
    when its owner exits, after --max-time, and on TERM. --no-keeper leaves the lock
    to the lock service instead: until `lockrun release`, or --ttl after the last renew.
    """
    from lockrun import delivery, detached, keeper  # noqa: PLC0415 - off the run command's start-up

    _keep_secret(uri)
    if export and env_file is not None:
        msg = "--export prints for eval, --env-file writes a file: give one of them"
        raise click.UsageError(msg)
    if var != TOKEN_VARIABLE and not export and env_file is None:
        msg = "--var names the variable of --export or --env-file"
        raise click.UsageError(msg)
    delivery.check_variable(var)
    options = Options(
        name=name,
        uri=uri,
        slots=slots,
        wait=wait,
        ttl=ttl,
        max_time=max_time,
        verbose=verbose,
        namespace=namespace,
        shared=shared,
        hold_at_least=hold_at_least or 0.0,
        take_over=take_over,
    )
    who = _check_holding(options, owner, no_keeper=no_keeper)  # before --env-file is made
    private = () if env_file is None else (delivery.open_env_file(env_file),)

    def deliver(token: str) -> None:
        if private:
            delivery.append_line(private[0], f"{var}={token}", f"--env-file {env_file}")
        else:
            _print(f"export {var}={token}" if export else token)

    live = _LIVE.show if verbose and _on_terminal() else None
    try:
        if no_keeper:
            return detached.acquire(options, deliver, log=say, live=live)
        return keeper.acquire(
            options,
            who,
            lambda grant: deliver(str(grant.token)),
            log=say,
            live=live,
            private=private,
        )
    except LockBusy as err:
        if not quiet:
            say(str(err))
        return conflict_exit_code
    finally:
        for fd in private:
            with contextlib.suppress(OSError):  # closed in the keeper already
                os.close(fd)


def _check_holding(options: Options, owner: str | None, *, no_keeper: bool) -> int | None:
    """Check what only a keeper, or only --no-keeper, takes; return the keeper's owner pid."""
    from lockrun import detached, section  # noqa: PLC0415 - off the run command's start-up

    if no_keeper:
        _check_no_keeper(owner, options.max_time)
        detached.check_leased(parse_uri(options.uri))
        return None
    return section.default_owner() if owner is None else section.parse_owner(owner)


def _check_no_keeper(owner: str | None, max_time: float | None) -> None:
    """Refuse what needs a keeper, and a --ttl left to its default, with --no-keeper."""
    if owner is not None or max_time is not None:
        what = "--owner" if owner is not None else "--max-time"
        msg = (
            f"{what} is kept by a keeper; with --no-keeper nothing of ours runs, and the lock "
            "ends with `lockrun release`, or --ttl after the acquire or the last renew"
        )
        raise click.UsageError(msg)
    context = click.get_current_context()
    if context.get_parameter_source("ttl") is click.core.ParameterSource.DEFAULT:
        msg = (
            "--no-keeper holds the lock for --ttl after the acquire and after each renew, "
            "also when every job that knows the token is gone: give --ttl (e.g. --ttl 30m)"
        )
        raise click.UsageError(msg)


_token_argument: Final = click.argument("token", required=False, metavar="[TOKEN]")
_token_verbose: Final = click.option(
    "-v", "--verbose", is_flag=True, help="say what was done, also when all went well"
)


def _token(token: str | None) -> str:
    """Return *token*, else $LOCKRUN_TOKEN; a usage error if there is neither."""
    if token is None:
        token = os.environ.get(TOKEN_VARIABLE)
    if token is None:
        msg = f"no token: give TOKEN, or set {TOKEN_VARIABLE} (`lockrun acquire --export`)"
        raise click.UsageError(msg)
    return token


def _by_token(token: str | None, verb: str, uri: Callable[[], str]) -> str:
    """Ask the keeper of the token, or the service that keeps its lease, to *verb* it."""
    from lockrun import detached, door  # noqa: PLC0415 - off the run command's start-up

    text = _token(token)
    if not detached.is_lease_token(text):
        return door.ask(text, verb)
    chosen = uri()
    _keep_secret(chosen)
    return detached.release(text, chosen) if verb == "release" else detached.renew(text, chosen)


_LEASE_SERVICE: Final = "lock service of a --no-keeper token"
_TOKEN_GROUPS: Final = (("Options", ("uri", "uri_file", "verbose", "help")),)


@click.command(
    cls=_Grouped,
    groups=_TOKEN_GROUPS,
    context_settings=_CONTEXT,
    epilog="""\b
Example: at the end of a script, release what acquire took
  lockrun release "$TOKEN"

Exit status: 0 released; 76 nothing held (released already, owner exited,
lost, expired); 77 not yours; 79 taken over; 124 --max-time expired; 64 usage
or malformed token; 69 no answer; 78 a --no-keeper token of another URI.""",
)
@_uri_option(_LEASE_SERVICE, lazy=True)
@_token_verbose
@_token_argument
def release_command(verbose: bool, token: str | None, uri: Callable[[], str]) -> int:
    """Release the lock that `lockrun acquire` printed TOKEN for (default: $LOCKRUN_TOKEN)."""
    said = _by_token(token, "release", uri)
    if verbose:
        say(said)
    return 0


@click.command(
    cls=_Grouped,
    groups=_TOKEN_GROUPS,
    context_settings=_CONTEXT,
    epilog="""\b
Example: hold a lock of at most 30 minutes, counted again between two steps
  eval "$(lockrun acquire --export --max-time 30m deploy)"
  ./migrate.sh && lockrun renew && ./restart.sh
  lockrun release

Exit status: 0 held; 76 not held (released, owner exited, lost, expired); 77
not yours; 79 taken over (a --no-keeper lease is released); 124 --max-time
expired; 64 usage or malformed token; 69 no answer; 78 a --no-keeper token
of another URI.""",
)
@_uri_option(_LEASE_SERVICE, lazy=True)
@_token_verbose
@_token_argument
def renew_command(verbose: bool, token: str | None, uri: Callable[[], str]) -> int:
    """Confirm TOKEN's lock is held, and count its --max-time (or --no-keeper's --ttl) again."""
    said = _by_token(token, "renew", uri)
    if verbose:
        say(said)
    return 0


SUBCOMMANDS: Final = {
    "status": (status_command, "show who holds or waits for a lock"),
    "acquire": (acquire_command, "take a lock and keep it until released"),
    "release": (release_command, "release a lock that acquire took"),
    "renew": (renew_command, "confirm a lock acquire took, and restart its --max-time"),
}


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
    """Say what *person* does: ``holding``, ``waiting``, ``sharing``, ``held until 12:03:04``.

    A lease with no process (acquire --no-keeper): ``no process, until 12:03:04``.
    """
    if person.until is not None:
        return f"held until {clock_time(person.until)}"
    if person.detached:
        until = "" if person.expires is None else f", until {clock_time(person.expires)}"
        return f"{'sharing, ' * person.shared}no process{until}"
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
    flockwait.claim_signals()  # our process: a timed flock(2) may use ITIMER_REAL (A1)
    if instruction := os.environ.get(COMPLETE_VAR):  # the completion scripts call us back
        _exit(_complete(instruction))
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
    word, given = _first_word(args)
    if word is None or args[word] not in SUBCOMMANDS:
        return run_command, "lockrun", args
    subcommand = args[word]
    command = SUBCOMMANDS[subcommand][0]
    taken = _grammar(command)
    for option in given:
        if option not in taken:
            msg = (
                f"'{subcommand}' is a subcommand and takes no {option}: put the subcommand "
                f"first (lockrun {subcommand} [OPTIONS] …), or write 'lockrun [OPTIONS] -- "
                f"{subcommand} …' to run a program called {subcommand}"
            )
            raise click.UsageError(msg)
    return command, f"lockrun {subcommand}", args[:word] + args[word + 1 :]


def _grammar(command: click.Command) -> dict[str, bool]:
    """Map each spelling of *command*'s options (``-u``, ``--uri``) to whether it takes a value."""
    spellings: dict[str, bool] = dict.fromkeys(_HELP, False)
    for param in command.params:
        if isinstance(param, click.Option):
            takes = not param.is_flag and not param.count
            spellings.update(dict.fromkeys([*param.opts, *param.secondary_opts], takes))
    return spellings


def _first_word(args: list[str]) -> tuple[int | None, list[str]]:
    """Return where the first word that is no option nor an option's value is, and the options.

    As click reads options: ``--uri=X``, ``--uri X``, ``-uX``, ``-u X``, ``-qv``; a value is
    taken by the spelling of any command that knows it. None after ``--``, or with no word.
    """
    values = {
        spelling
        for command in (run_command, *(each for each, _ in SUBCOMMANDS.values()))
        for spelling, takes in _grammar(command).items()
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
    try:
        command, prog, args = dispatch(args)
    except click.UsageError:  # a subcommand after options it does not take: nothing fits
        return []
    if command is not run_command:
        return type(completer)(command, {}, prog, COMPLETE_VAR).get_completions(args, incomplete)
    context = run_command.make_context("lockrun", list(args), resilient_parsing=True)
    if context.params.get("command"):  # past the command word, every word is the command's
        return _offer({incomplete: None}, "file")
    items = completer.get_completions(args, incomplete)
    word, given = _first_word([*args, "word"])
    if word == len(args) and not incomplete.startswith("-"):
        # Where the command word goes: a subcommand that takes the options given fits too.
        items[:0] = _offer(
            {
                word: what
                for word, (subcommand, what) in SUBCOMMANDS.items()
                if word.startswith(incomplete) and set(given) <= _grammar(subcommand).keys()
            }
        )
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


# Fewer than lockrun's own descriptors (the lock's, the guardian's switch, the watch's
# pipes, a server's sockets: 9 to 13 of them) failed anywhere inside it, an import included.
MIN_OPEN_FILES: Final = 16


def _check_open_files() -> None:
    """Raise `OutOfFiles` for a `ulimit -n` too small for lockrun to run at all."""
    limit = os.sysconf("SC_OPEN_MAX")  # the soft RLIMIT_NOFILE; -1 if unlimited
    if 0 <= limit < MIN_OPEN_FILES:
        msg = f"ulimit -n {limit} is too small for lockrun: it needs {MIN_OPEN_FILES} open files"
        raise OutOfFiles(msg)


def _exit_status(command: click.Command, prog: str, args: list[str]) -> int:
    try:
        _check_open_files()
        result = command.main(
            args, prog_name=prog, standalone_mode=False, auto_envvar_prefix="LOCKRUN"
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
