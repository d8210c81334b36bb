"""The CLI's runner: take a slot, run the command under it, and say what happened.

`run` is what ``lockrun [OPTIONS] -- COMMAND`` does: the options' checks, the wait (with its
signals and its progress line), the spawn under `lockrun.supervise`, and the status. The
Python API (`lockrun.lock.Lock`) shares `acquire` and the defaults with it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final, NamedTuple, cast

from lockrun.backends import (
    Backend,
    Lease,
    Leased,
    LockState,
    Request,
    open_backend,
    parse_uri,
)
from lockrun.bounds import (
    MAX_KILL_AFTER,
    MAX_WAIT,
    check_modes,
    check_seconds,
    check_slots,
    check_ttl,
    check_wait,
)
from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    ExitCode,
    LeaseLost,
    TakenOver,
    TimedOut,
    UsageError,
)
from lockrun.hold import (
    Waiting,
    acquired,
    deferred,
    interruptible,
    make_request,
    quiet,
    release,
    report_for,
    take,
)
from lockrun.lock import DEFAULT_NAMESPACE
from lockrun.names import check_name, default_name
from lockrun.supervise import FORWARDED, Limits, find_program, supervise
from lockrun.timing import DEFAULT_TTL, now
from lockrun.uri import DEFAULT_URI, redact

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from lockrun.guardian import Guardian, OnDemand
    from lockrun.monitor import Account
    from lockrun.progress import WaitReport
    from lockrun.uri import LockURI

DEFAULT_KILL_AFTER: Final = 10.0
# Once the lock is known gone someone else may hold it: a short grace (docs/semantics.md G3).
DEFAULT_LOST_KILL_AFTER: Final = 1.0
DEFAULT_HOOK_MAX_TIME: Final = 60.0  # a hook that pings a monitor, retries included


class Options(NamedTuple):
    """The CLI's options, with durations in seconds and None for forever or none.

    docs/semantics.md "Options" describes each.
    """

    name: str | None = None
    uri: str = DEFAULT_URI
    slots: int = 1
    wait: float | None = 0.0
    ttl: float = DEFAULT_TTL
    max_time: float | None = None
    kill_after: float = DEFAULT_KILL_AFTER
    namespace: str = DEFAULT_NAMESPACE
    close: bool = False
    verbose: bool = False
    lost_kill_after: float = DEFAULT_LOST_KILL_AFTER
    shared: bool = False
    hold_at_least: float = 0.0  # 0: the lock is free once the command ended
    take_over: bool = False
    # Monitoring (docs/semantics.md "Monitoring"): lockrun.monitor, imported only for them.
    conflict_exit_code: int = ExitCode.BUSY  # -E: what busy exits with, as a hook is told
    on_busy: str | None = None
    on_exit: str | None = None
    on_start: str | None = None
    hook_max_time: float = DEFAULT_HOOK_MAX_TIME
    metrics_file: str | None = None


def run(
    argv: Sequence[str],
    options: Options,
    *,
    log: Callable[[str], None],
    live: Callable[[str], None] | None = None,
) -> int:
    """Run *argv* under the lock of *options*; return its status.

    What it raises maps to an exit status (docs/semantics.md "Exit status").

    *log* gets lockrun's lines. With *live* (a terminal), ``-v`` shows the wait as one line
    that *live* redraws in place; an empty string erases it.

    Meant for a process that exits with the result: once the lock was held, INT, TERM and
    HUP are left ignored, so a late signal cannot replace the command's status.
    """
    uri = parse_uri(options.uri)
    check_options(options, uri)
    name = check_name(options.name) if options.name is not None else default_name(argv)
    namespace = check_name(options.namespace, "namespace")
    verbose = log if options.verbose else quiet
    if options.name is None:
        verbose(f"lock name {name} (derived from the command; set it with --name)")
    request = make_request(options, namespace, name, argv)
    account = _account(options, request, log)
    try:
        with interruptible(name, verbose) as waiting:
            account.ignored = waiting.ignored
            backend = open_backend(uri, ttl=options.ttl, warn=log, note=verbose)
            guardian = _guardian(uri, options, backend)
            if guardian is not None and uri.kind.tells_waiting:  # forked as it begins to wait
                request = request._replace(waiting=guardian.watch_lease)  # freed should we die
            elif guardian is not None:
                guardian.now()  # before the run connects (docs/design.md A11)
            try:
                report = report_for(options, request, uri, log, live)
                status = _hold_and_run(
                    backend, request, argv, options, verbose, guardian, waiting, report, account
                )
            finally:
                if guardian is not None:
                    guardian.stand_down()
                backend.close()
    except Exception as err:
        account.close(err, conflict=options.conflict_exit_code)  # the guardian's fds are closed
        raise
    account.close(status, conflict=options.conflict_exit_code)
    return status


def _guardian(uri: LockURI, options: Options, backend: Backend) -> OnDemand | None:
    """Return the guardian, not forked yet, of a run whose command does not hold the lock.

    Only lock fds the command inherits keep the lock if we die; otherwise a guardian must
    take the command's group down with us (docs/semantics.md G2), and free a lease that
    would outlive us (G5). One forked after the run connected drops its copies of the
    connections (`Scheme.tells_waiting`).
    """
    if uri.kind.inherits_fds and not options.close:
        return None
    from lockrun.guardian import Guardian, OnDemand  # noqa: PLC0415 - a file: run's has none

    abandon = cast("Leased", backend).abandon if uri.kind.leased else None
    inherited = backend.close if uri.kind.tells_waiting else None
    return OnDemand(lambda: Guardian(abandon, inherited))


class _Unmonitored:
    """The account of a run that nothing monitors: `monitor.Account`'s shape, noting nothing."""

    def __init__(self) -> None:
        """Note nothing ignored yet."""
        self.ignored: frozenset[int] = frozenset()

    def held(self, slot: int, fence: int | None) -> None:
        """Note nothing."""

    def starting(self) -> None:
        """Start no hook."""

    def released(self) -> None:
        """Note nothing."""

    def close(self, result: int | BaseException, *, conflict: int) -> None:
        """Report nothing."""


def _account(
    options: Options, request: Request, log: Callable[[str], None]
) -> Account | _Unmonitored:
    """Return the account of the run: `monitor.Account` if something monitors it."""
    if not (options.on_start or options.on_busy or options.on_exit or options.metrics_file):
        return _Unmonitored()
    from lockrun.monitor import Account  # noqa: PLC0415 - unmonitored runs do without it

    return Account(options, request, redact(options.uri), log)


def _hold_and_run(
    backend: Backend,
    request: Request,
    argv: Sequence[str],
    options: Options,
    verbose: Callable[[str], None],
    guardian: OnDemand | None,
    waiting: Waiting,
    report: WaitReport | None,
    account: Account | _Unmonitored,
) -> int:
    started = now()
    environment = base_environment(request)  # before the wait: off the hand-over's path
    program = find_program(argv[0]) if argv else None  # and the PATH search
    lease = take(backend, request, options.wait, report)
    # From here on the signals of FORWARDED belong to the command: supervise() forwards them
    # while it runs, and one that comes after it ended must not rewrite its exit status. One
    # that lands before they are deferred still finds the slot released by the finally below,
    # with no --hold-at-least window: nothing ran.
    held_since, hold = started, 0.0
    guarding: Guardian | None = None
    released = False

    def release_now() -> None:
        """Release the slot, once: as the command ends (`supervise`'s *ended*), else below."""
        nonlocal released
        if released:
            return
        released = True
        account.released()
        # A release that may leave a --hold-at-least window is ours alone: the guardian's
        # free would cut it, so it is told, and were we to die meanwhile the lease lapses.
        # Any other it need not hear of: telling woke it beside the release (0.3 ms of
        # etcd's hand-over, issue #33), and should we die meanwhile it frees the lease.
        if guarding is not None and hold > 0:
            guarding.forget()
        release(lease, request, held_since, hold, verbose)

    try:
        guarding = None if guardian is None else guardian.now()  # before the spawn
        held_since, hold = now(), options.hold_at_least
        account.held(lease.slot, lease.fence)
        with deferred(FORWARDED):
            waiting.over = True
            if report is not None:  # here, where a signal cannot skip the release
                report.stop()
            if options.verbose:
                verbose(acquired(request, lease, started))
            limits = Limits(
                options.ttl / 3,
                options.max_time,
                options.kill_after,
                min(options.kill_after, options.lost_kill_after),
            )
            if guarding is not None:
                guarding.hold_fds(lease.fds, lease.orphan)
            # Started now and never waited for: it runs beside the command, and a slow ping
            # lengthens neither the hold nor the hand-over (docs/semantics.md "Monitoring").
            # Before the spawn, which makes the lock's fds inheritable.
            account.starting()
            return supervise(
                argv,
                lease,
                limits,
                env=command_environment(request, lease, environment),
                # A session's socket too: a server frees the lock when its last holder
                # closes it, which the kernel does only once the command's processes are
                # dead, even when lockrun and its guardian die at once (docs/semantics.md G2).
                pass_fds=lease.fds if guarding is None or lease.sessions else (),
                guardian=guarding,
                forward=FORWARDED - waiting.ignored,  # not what nohup had us ignore
                log=verbose,
                program=program,
                ended=release_now,
            )
    except (
        CommandNotFound,
        CommandNotExecutable,
        BackendUnavailable,  # the lease could not be confirmed before the spawn
        LeaseLost,
        TakenOver,
        TimedOut,
    ) as err:
        if not isinstance(err, TimedOut):  # a run that was cut short keeps its window, but
            hold = 0.0  # nothing ran, a lost lock is no one's, and a taker runs next
        # docs/semantics.md "Exit status": every lockrun-made status line names the lock.
        err.about(request.name)
        raise
    finally:
        release_now()


def check_options(options: Options, uri: LockURI) -> None:
    """Raise `UsageError` for *options* out of their bounds (`lockrun.bounds`) or *uri*'s.

    *uri* is ``options.uri`` as the caller parsed it: the modes its scheme offers, --close.
    """
    if options.close and not uri.kind.inherits_fds:
        msg = f"--close applies to the file: backend only, not {uri.scheme}:"
        raise UsageError(msg)
    check_slots(options.slots, "--slots")
    check_wait(options.wait, "--wait")
    check_ttl(options.ttl, "--ttl")
    if options.max_time is not None:  # 0 would stop every command
        check_seconds(options.max_time, "--max-time", high=MAX_WAIT, above=True)
    check_seconds(options.kill_after, "--kill-after", high=MAX_KILL_AFTER)
    check_seconds(options.lost_kill_after, "--lost-kill-after", high=MAX_KILL_AFTER)
    check_modes(
        options.slots,
        shared=options.shared,
        hold=options.hold_at_least,
        take_over=options.take_over,
        cli=True,
        scheme=uri.scheme,
    )
    if options.take_over and options.wait == 0:
        msg = "--take-over waits for the holders to stop: give it a --wait (e.g. --wait 1m)"
        raise UsageError(msg)
    check_seconds(options.hook_max_time, "--hook-max-time", high=MAX_KILL_AFTER, above=True)
    if options.metrics_file:
        from lockrun.metrics import check_path  # noqa: PLC0415 - only for runs that use it

        check_path(options.metrics_file)


def base_environment(request: Request) -> dict[str, str]:
    """Return the command's environment but what the grant says: ours plus LOCKRUN_NAME/SLOTS."""
    env = dict(os.environ)
    if "LOCKRUN_URI" in env:
        # No password reaches the command; a lockrun it runs finds *** in the URI and
        # refuses it (78) rather than fall back to file: (docs/security.md "Passwords in URIs").
        env["LOCKRUN_URI"] = redact(env["LOCKRUN_URI"])
    env |= {"LOCKRUN_NAME": request.name, "LOCKRUN_SLOTS": str(request.slots)}
    env.pop("LOCKRUN_FENCE", None)
    return env


def command_environment(
    request: Request, lease: Lease, base: dict[str, str] | None = None
) -> dict[str, str]:
    """Return the command's environment: ours plus LOCKRUN_NAME/SLOT/SLOTS/FENCE.

    *base* is `base_environment`'s, made before the wait (it is added to).
    """
    env = base_environment(request) if base is None else base
    env["LOCKRUN_SLOT"] = str(lease.slot)
    if lease.fence is not None:
        env["LOCKRUN_FENCE"] = str(lease.fence)
    return env


def states_for_status(uri: str, namespace: str, name: str | None) -> list[LockState]:
    """Return what `lockrun status` shows."""
    if name is not None:
        check_name(name)
    backend = open_backend(parse_uri(uri))
    try:
        return backend.status(check_name(namespace, "namespace"), name)
    finally:
        backend.close()


__all__ = ["Options", "run", "states_for_status"]
