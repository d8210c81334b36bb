"""The statements that wait for a PostgreSQL advisory lock, and how a wait is ended."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from lockrun.backends.sessionlock import GATE
from lockrun.timing import now

from . import modes
from .rows import stop_taken
from .session import LOCK_NOT_AVAILABLE, NO_ANSWER, QUERY_CANCELED, NoAnswer, PgError, results

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lockrun.backends.sessionlock import Attempt
    from lockrun.errors import BackendUnavailable

    from .grant import Ahead
    from .keys import Keys
    from .server import Server
    from .session import Row, Session

_MAX_LOCK_TIMEOUT: Final = 2_147_483_647  # ms: the largest lock_timeout; 0 would mean none
_CANCEL_AGAIN: Final = 0.05  # s: a cancel that got no answer by then may have been dropped


def wait_for(seconds: float | None, key: int, *, shared: bool = False) -> str:
    """Return a statement that waits for *key* at most *seconds* (None: forever).

    lock_timeout is set in FROM, which runs before the target list; 0 would mean forever.
    A shared wait queues with the exclusive ones, in arrival order: a reader that comes
    after a queued writer waits behind it (PostgreSQL's lock queue, docs/design.md A8).
    """
    wait, limit = _wait(seconds, key, shared=shared)
    return f"SELECT {wait} FROM {limit}"


def try_then_wait(seconds: float | None, key: int, *, shared: bool = False) -> str:
    """Return `wait_for`'s statement, answering ``free`` if a try got *key* without a wait.

    CASE runs the try first and waits only if it failed: a free lock has no queue, so
    the order is the queue's either way. The answer says whether the slot was contended.
    """
    wait, limit = _wait(seconds, key, shared=shared)
    mode = "_shared" if shared else ""
    return (
        f"SELECT CASE WHEN pg_try_advisory_lock{mode}({key}::bigint) THEN 'free' "
        f"ELSE {wait}::text END FROM {limit}"
    )


def _wait(seconds: float | None, key: int, *, shared: bool) -> tuple[str, str]:
    """Return the wait's call and the FROM item that sets its lock_timeout first."""
    limit = 0 if seconds is None else min(_MAX_LOCK_TIMEOUT, max(1, math.ceil(seconds * 1000)))
    function = "pg_advisory_lock_shared" if shared else "pg_advisory_lock"
    return f"{function}({key}::bigint)", f"set_config('lock_timeout', '{limit}ms', false)"


def first_free(keys: Keys) -> str:
    """Return a statement that takes the first free slot (CASE stops at the first) or -1."""
    tries = " ".join(
        f"WHEN pg_try_advisory_lock({key}) THEN {slot}" for slot, key in enumerate(keys.slots)
    )
    return f"SELECT CASE {tries} ELSE -1 END"


def queue(
    server: Server,
    session: Session,
    key: int,
    part: int | str,
    seconds: float | None,
    attempt: Attempt[Session, Keys, Ahead],
    grant: Sequence[str] = (),
) -> tuple[list[list[Row]], PgError | None]:
    """Wait for *key* up to *seconds*: `results` of the wait, *grant*, the window check.

    A taker takes the stop key first, in a transaction of its own, whose commit sends
    the holders its NOTIFY while it waits. The statements of *grant* run right after
    the wait, in the same message: PREPAREs go before the wait, so they run whatever
    the wait's end (a prepared statement outlives its transaction). A one-slot wait
    then reads the window.
    """
    prepares = [statement for statement in grant if statement.startswith("PREPARE ")]
    wait = try_then_wait if grant else wait_for
    statements = [
        *prepares,
        wait(seconds, key, shared=attempt.request.shared and part != GATE),
        *(statement for statement in grant if not statement.startswith("PREPARE ")),
    ]
    asking = attempt.request.take_over and not session.stopping
    if asking:
        statements[:0] = modes.ask_to_stop(attempt.key)
        session.stopping = True
    if attempt.slots == 1:  # a statement of its own: its snapshot is taken after the wait
        statements += modes.window_check(server, session, key)
    session.send_simple(*statements)
    answers, error = results(session, None if seconds is None else seconds + server.timeout)
    if asking and answers:
        session.stopping = stop_taken(answers.pop(0))
        if not session.stopping:
            server.note(
                f"{server.where}: the stop key of {attempt.request.name} is held "
                "exclusively by another session: this wait asks no holder to stop"
            )
    return answers, error


def ran_out(error: PgError | None, cancelled: BackendUnavailable) -> bool:
    """Return False for a wait that ran out (lock_timeout); raise what else ended it.

    A wait cancelled on the server (a DBA's, or our own head's) is *cancelled*.
    """
    if error is not None and error.sqlstate == LOCK_NOT_AVAILABLE:
        return False
    if error is not None and error.sqlstate == QUERY_CANCELED:
        raise cancelled from error
    raise error or PgError(NO_ANSWER)


def terminate(session: Session, pids: Sequence[int], timeout: float) -> None:
    """From *session*, end the server sessions *pids*: their waits leave the queue now."""
    session.rows(
        "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid",
        "{" + ",".join(map(str, pids)) + "}",
        timeout=timeout,
    )


def cancel_first(server: Server, winner: Session, first: Session) -> None:
    """Cancel the first session's wait on slot 0 until it answers.

    A cancel that reaches the server between two statements is dropped, and the first
    session may just have sent its next piece of the wait: so ask again until it ends.
    """
    deadline = now() + server.ttl / 3 + server.timeout  # a piece ends by itself by then
    while True:
        winner.rows("SELECT pg_cancel_backend($1)", first.pid, timeout=server.timeout)
        try:
            first.receive(_CANCEL_AGAIN)
        except NoAnswer:
            if now() > deadline:
                raise
            continue
        except PgError as err:
            if err.sqlstate not in {QUERY_CANCELED, LOCK_NOT_AVAILABLE}:
                raise
        return
