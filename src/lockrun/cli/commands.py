"""The run command, which runs a command while holding a lock, and the subcommands' table."""

from __future__ import annotations

from typing import Final

import click

from lockrun.cli.output import (
    LIVE,
    on_terminal,
    print_stdout,
    register_secret,
    say,
    status_text,
)
from lockrun.cli.params import (
    CONTEXT,
    URI_HELP,
    Duration,
    Grouped,
    complete_command,
    conflict_option,
    hold_at_least_option,
    namespace_option,
    quiet_option,
    shared_option,
    show_version,
    slots_option,
    take_over_option,
    ttl_option,
    uri_option,
    verbose_option,
    wait_option,
)
from lockrun.cli.tokens import acquire_command, release_command, renew_command
from lockrun.errors import ExitCode, LockBusy
from lockrun.lock import describe
from lockrun.runner import (
    DEFAULT_HOOK_MAX_TIME,
    DEFAULT_KILL_AFTER,
    DEFAULT_LOST_KILL_AFTER,
    Options,
    run,
    states_for_status,
)
from lockrun.timing import format_duration
from lockrun.uri import redact

_STATUS_OUTPUT: Final = ("as_json", "check", "quiet", "help")


@click.command(
    cls=Grouped,
    groups=(("Locking", ("uri", "uri_file", "namespace")), ("Output", _STATUS_OUTPUT)),
    context_settings=CONTEXT,
    epilog="""\b
Example: in a script, skip a step while a backup is running
  lockrun status --check -q backup || exit 0

Exit status: 0; with --check, 0 if NAME is free and 75 if anyone holds it
(waiters alone do not count); 64 usage; 69 lock service unavailable; 74 could
not write; 78 configuration.""",
)
@uri_option(URI_HELP)
@namespace_option
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
    register_secret(uri)
    if check and name is None:
        msg = "--check needs a NAME: lockrun status --check NAME"
        raise click.UsageError(msg)
    states = states_for_status(uri, namespace, name)
    if not quiet:
        print_stdout(status_text(states, as_json=as_json, empty=f"{namespace} at {redact(uri)}"))
    holders = [holder for state in states for holder in state.holders]
    if not check or not holders:
        return 0
    if not quiet:
        say(f"{name} is held by {'; '.join(describe(holder) for holder in holders)}")
    return ExitCode.BUSY


SUBCOMMANDS: Final = {
    "status": (status_command, "show who holds or waits for a lock"),
    "acquire": (acquire_command, "take a lock and keep it until released"),
    "release": (release_command, "release a lock that acquire took"),
    "renew": (renew_command, "confirm a lock acquire took, and restart its --max-time"),
}


_RUN_GROUPS: Final = (
    ("Locking", ("name", "uri", "uri_file", "namespace", "slots", "shared", "conflict_exit_code")),
    ("Waiting and time limits", ("wait", "ttl", "max_time", "kill_after", "lost_kill_after")),
    ("Modes", ("hold_at_least", "take_over", "close")),
    ("Monitoring", ("on_start", "on_exit", "on_busy", "hook_max_time", "metrics_file")),
    ("Output", ("quiet", "verbose", "version", "help")),
)


@click.command(
    cls=Grouped,
    groups=_RUN_GROUPS,
    subcommands=SUBCOMMANDS,
    context_settings=CONTEXT | {"allow_interspersed_args": False},
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
@uri_option(URI_HELP)
@slots_option
@wait_option
@ttl_option
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
@conflict_option
@shared_option
@hold_at_least_option
@take_over_option
@namespace_option
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
@quiet_option
@verbose_option
@click.option(  # not click.version_option, which looks a translation up (Grouped.get_help_option)
    "-V",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    allow_from_autoenv=False,  # LOCKRUN_VERSION=1 must not turn every run into a version
    callback=show_version,
    help="show the version and exit",
)
@click.argument(
    "command",
    nargs=-1,
    type=click.UNPROCESSED,
    metavar="[--] COMMAND [ARG]...",
    shell_complete=complete_command,
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
    register_secret(uri)
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
    live = LIVE.show if verbose and on_terminal() else None
    try:
        return run(command, options, log=say, live=live)
    except LockBusy as err:
        if not quiet:
            say(str(err))
        return conflict_exit_code
