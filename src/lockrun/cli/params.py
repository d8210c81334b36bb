"""The commands' parameters: DURATION, the shared options, their Tab values, --help's headings."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import click

from lockrun import __version__
from lockrun.bounds import MAX_SLOTS
from lockrun.errors import ExitCode, UsageError
from lockrun.lock import DEFAULT_NAMESPACE
from lockrun.timing import DEFAULT_TTL, format_duration, parse_duration
from lockrun.uri import SCHEMES
from lockrun.urifile import choose_uri

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from click.shell_completion import CompletionItem

_Command = TypeVar("_Command", bound="Callable[..., object]")
HELP: Final = ("-h", "--help")
# 80 columns: --help lays out the same on every terminal, one line an option where it can.
CONTEXT: Final = {"help_option_names": list(HELP), "max_content_width": 80}


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
        return offer({"forever": "wait as long as it takes"} if wanted else {})


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


def offer(values: dict[str, str | None], kind: str = "plain") -> list[CompletionItem]:
    """Return completion items for *values* (value: help), importing click's module now."""
    from click.shell_completion import CompletionItem  # noqa: PLC0415 - only Tab pays for it

    return [CompletionItem(value, type=kind, help=what) for value, what in values.items()]


def complete_uri(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Offer each scheme's start that *incomplete* begins."""
    del ctx, param
    return offer(
        {start: what for start, what in URI_STARTS.items() if start.startswith(incomplete)}
    )


def complete_file(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Let the shell complete a path."""
    del ctx, param
    return offer({incomplete: None}, "file")


def complete_command(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Offer the programs on $PATH, or a path after the command word."""
    del param
    if ctx.params.get("command") or "/" in incomplete:  # the command's arguments, or a path
        return offer({incomplete: None}, "file")
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
    return offer(dict.fromkeys(sorted(found)))


def _show_help(ctx: click.Context, _param: click.Parameter, value: object) -> None:
    """Print the command's help and exit, as click's own --help does."""
    if value and not ctx.resilient_parsing:
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


def show_version(ctx: click.Context, _param: click.Parameter, value: object) -> None:
    """Print ``lockrun, version X`` and exit, as click's version option would."""
    if value and not ctx.resilient_parsing:
        click.echo(f"lockrun, version {__version__}", color=ctx.color)
        ctx.exit()


class Grouped(click.Command):
    """A command whose --help lists its options under headings, one line each where it can.

    *groups* names each heading's options in order (tests/test_help.py checks that each
    option is under exactly one); *subcommands* (`SUBCOMMANDS`, the run command's) come
    first, as git lists them.
    """

    def __init__(
        self,
        *args: Any,  # noqa: ANN401 - click.Command's own, passed on as they are
        groups: Sequence[tuple[str, Sequence[str]]],
        subcommands: Mapping[str, tuple[click.Command, str]] | None = None,
        **kwargs: Any,  # noqa: ANN401
    ) -> None:
        """Make the command, with its --help laid out as *groups* says."""
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.subcommands = subcommands or {}
        self.help_option: click.Option | None = None

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        """Return -h/--help, with a help line in the style of the others.

        Made here, not by click's `help_option`, which looks a translation of its own help
        line up even when given another: gettext's first lookup imports locale and searches
        the file system, about 2 ms of every run's start-up (issue #32).
        """
        names = self.get_help_option_names(ctx)
        if not names or not self.add_help_option:
            return None
        if self.help_option is None:  # one object: click orders eager options by identity
            self.help_option = click.Option(
                names,
                is_flag=True,
                expose_value=False,
                is_eager=True,
                allow_from_autoenv=False,  # LOCKRUN_HELP=1 must not turn every run into help
                callback=_show_help,
                help="show this help and exit",
            )
        return self.help_option

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the usage line, and the subcommands' under it."""
        super().format_usage(ctx, formatter)
        if self.subcommands:
            formatter.write(f"{'':{formatter.current_indent}}       lockrun SUBCOMMAND [ARGS]...\n")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the subcommands, then each group of options under its heading."""
        if self.subcommands:
            with formatter.section("Subcommands (lockrun SUBCOMMAND --help)"):
                formatter.write_dl([(word, what) for word, (_, what) in self.subcommands.items()])
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


URI_HELP: Final = "where the lock lives: file: (default), redis:…"


def uri_option(what: str, *, lazy: bool = False) -> Callable[[_Command], _Command]:
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
            shell_complete=complete_file,
            help="read the URI from a file (no password in ps)",
        )
        uri = click.option(
            "-u",
            "--uri",
            metavar="URI",
            allow_from_autoenv=False,  # LOCKRUN_URI: choose_uri reads it, in its turn
            shell_complete=complete_uri,
            help=what,
        )
        return cast("_Command", uri(uri_file(chosen)))

    return options


namespace_option: Final = click.option(  # each use makes an option of its own
    "--namespace",
    metavar="NS",
    default=DEFAULT_NAMESPACE,
    help=f"a separate set of lock names (default: {DEFAULT_NAMESPACE})",
)


slots_option: Final = click.option(
    "-s",
    "--slots",
    type=click.IntRange(1, MAX_SLOTS),
    metavar="N",
    default=1,
    allow_from_autoenv=False,  # LOCKRUN_SLOTS is what a command is told, not a setting
    help=f"semaphore: at most N holders at once (1 to {MAX_SLOTS})",
)
wait_option: Final = click.option(
    "-w",
    "--wait",
    type=Duration(allow_forever=True),
    default="0",
    help="wait this long: 0 tries once (default), forever",
)
ttl_option: Final = click.option(
    "--ttl",
    type=Duration(),
    default=format_duration(DEFAULT_TTL),
    help=f"lease length, renewed every ttl/3 (default {format_duration(DEFAULT_TTL)})",
)
conflict_option: Final = click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    metavar="N",
    default=int(ExitCode.BUSY),
    help=f"exit status when the lock is busy (default {int(ExitCode.BUSY)})",
)
shared_option: Final = click.option(
    "--shared/--exclusive",
    default=False,
    allow_from_autoenv=False,  # per lock, like --slots: a nested lockrun must not inherit it
    help="share the lock with other readers, or not",
)
hold_at_least_option: Final = click.option(
    "--hold-at-least",
    type=Duration(),
    default=None,
    allow_from_autoenv=False,
    help="keep the lock taken this long after the grant",
)
take_over_option: Final = click.option(
    "--take-over",
    is_flag=True,
    allow_from_autoenv=False,
    help="stop the holders (they exit 79), then take it",
)
quiet_option: Final = click.option(
    "-q", "--quiet", is_flag=True, help="say nothing when the lock is busy"
)
verbose_option: Final = click.option(
    "-v", "--verbose", is_flag=True, help="report waiting, acquiring and releasing"
)
