"""Subcommands that hold a lock across steps: acquire prints a token, release and renew take it."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Final

import click

from lockrun.backends import parse_uri
from lockrun.cli.output import LIVE, on_terminal, print_stdout, register_secret, say
from lockrun.cli.params import (
    CONTEXT,
    URI_HELP,
    Duration,
    Grouped,
    conflict_option,
    hold_at_least_option,
    namespace_option,
    quiet_option,
    shared_option,
    slots_option,
    take_over_option,
    ttl_option,
    uri_option,
    verbose_option,
    wait_option,
)
from lockrun.errors import LockBusy
from lockrun.runner import Options

if TYPE_CHECKING:
    from collections.abc import Callable

TOKEN_VARIABLE: Final = "LOCKRUN_TOKEN"  # noqa: S105 - a variable's name, not a password


@click.command(
    cls=Grouped,
    groups=(
        ("Locking", ("uri", "uri_file", "namespace", "slots", "shared", "conflict_exit_code")),
        ("Waiting and time limits", ("wait", "ttl", "max_time")),
        ("Holding", ("owner", "no_keeper", "hold_at_least", "take_over")),
        ("The token", ("export", "env_file", "var")),
        ("Output", ("quiet", "verbose", "help")),
    ),
    context_settings=CONTEXT,
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
@uri_option(URI_HELP)
@slots_option
@wait_option
@ttl_option
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
@conflict_option
@shared_option
@hold_at_least_option
@take_over_option
@namespace_option
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
@quiet_option
@verbose_option
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

    register_secret(uri)
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
            print_stdout(f"export {var}={token}" if export else token)

    live = LIVE.show if verbose and on_terminal() else None
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
    register_secret(chosen)
    return detached.release(text, chosen) if verb == "release" else detached.renew(text, chosen)


_LEASE_SERVICE: Final = "lock service of a --no-keeper token"
_TOKEN_GROUPS: Final = (("Options", ("uri", "uri_file", "verbose", "help")),)


@click.command(
    cls=Grouped,
    groups=_TOKEN_GROUPS,
    context_settings=CONTEXT,
    epilog="""\b
Example: at the end of a script, release what acquire took
  lockrun release "$TOKEN"

Exit status: 0 released; 76 nothing held (released already, owner exited,
lost, expired); 77 not yours; 79 taken over; 124 --max-time expired; 64 usage
or malformed token; 69 no answer; 78 a --no-keeper token of another URI.""",
)
@uri_option(_LEASE_SERVICE, lazy=True)
@_token_verbose
@_token_argument
def release_command(verbose: bool, token: str | None, uri: Callable[[], str]) -> int:
    """Release the lock that `lockrun acquire` printed TOKEN for (default: $LOCKRUN_TOKEN)."""
    said = _by_token(token, "release", uri)
    if verbose:
        say(said)
    return 0


@click.command(
    cls=Grouped,
    groups=_TOKEN_GROUPS,
    context_settings=CONTEXT,
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
@uri_option(_LEASE_SERVICE, lazy=True)
@_token_verbose
@_token_argument
def renew_command(verbose: bool, token: str | None, uri: Callable[[], str]) -> int:
    """Confirm TOKEN's lock is held, and count its --max-time (or --no-keeper's --ttl) again."""
    said = _by_token(token, "renew", uri)
    if verbose:
        say(said)
    return 0
