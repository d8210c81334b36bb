"""A PostgreSQL grant in one round trip: the fence, the holder's name, the check of N."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.backends import slots_mismatch
from lockrun.bounds import MAX_SLOTS
from lockrun.timing import now

from . import fences, modes, waiting
from .keys import application_name, channel, comment, halves
from .rows import Drawn, Others
from .server import V13
from .session import LOCK_NOT_AVAILABLE, NO_ANSWER, QUERY_CANCELED, PgError, results

if TYPE_CHECKING:
    from lockrun.backends import Request
    from lockrun.backends.sessionlock import Attempt

    from .keys import Keys
    from .rows import Window
    from .server import Server
    from .session import Session

_NOBODY: Final = Others([], [])  # no check ran: the session's agreement stands
_SOONEST: Final = 0.001  # s: the shortest wait lock_timeout can say (1 ms)


class Ahead(NamedTuple):
    """What a grant's round trip learnt: its fence, and the rows of `lockrun_others`.

    *checked*: whether `lockrun_others` ran (else the session had proven N already).
    """

    fence: int | None
    others: Others
    checked: bool = True


def others(keys: Keys, slots: int) -> str:
    """Return the statement that finds users of another N and takers (`lockrun_others`)."""
    classid, objid = halves(keys.stop)
    return f"EXECUTE lockrun_others({keys.agreed}, {slots}, {classid}, {objid})"


def judge(found: Others, request: Request) -> None:
    """Raise `ConfigError` if *found* names a live user of *request*'s name with another N."""
    for user in found.users:
        if not 1 <= user.slots <= MAX_SLOTS:  # no lockrun takes (key, N) with such an N
            continue
        if user.who is None:  # another role's session: trust the 32-bit key
            raise slots_mismatch(request, user.slots)
        if (user.who.namespace, user.who.name) == (request.namespace, request.name):
            raise slots_mismatch(request, user.slots, user.who.holder)


def name(session: Session, attempt: Attempt[Session, Keys, Ahead], slot: int) -> None:
    """Have *session*'s statements name it the holder of *slot*, from now."""
    request = attempt.request
    session.holder = request.holder._replace(slot=slot, since=time.time(), shared=request.shared)
    session.tag = comment(request, attempt.token, session.holder)


def try_and_grant(server: Server, session: Session, attempt: Attempt[Session, Keys, Ahead]) -> bool:
    """Try a one-slot lock; if it was free, draw the fence in the same statement.

    One round trip either way, with the check of N after it: the grant's check if the
    try got the lock, else the one before queueing (`Statements.refuse_mismatch` reads it). A
    slot taken under a --hold-at-least window is waited out (`modes.sit_out`), and then
    granted afresh.
    """
    name(session, attempt, 0)
    attempt.sent = now()
    got, ahead, window = draw(server, session, attempt, 0, trying=True)
    attempt.state = ahead
    session.contended = not got
    if not got:  # nothing was granted: a waiter's statements name a waiter
        attempt.sent = None
        session.tag = attempt.tag
        return False
    if window is not None:
        judge(ahead.others, attempt.request)  # another N is said before busy
        modes.sit_out(server, session, attempt, window)
        attempt.sent = attempt.state = None  # `Statements.grant` draws the fence from now
        session.tangled = True  # that grant takes the (name, N) lock once more
    return True


def queues_at_once(session: Session, attempt: Attempt[Session, Keys, Ahead]) -> bool:
    """Whether *attempt* may skip its try and wait at once (`wait_and_grant` tries first).

    On a kept session whose last acquisition found the slot taken and that holds the
    (name, N) lock of a proven N: the try would likely fail, and a check of N before
    queueing would find nothing new. Not for a taker, which asks only once a try failed.
    """
    deadline = attempt.deadline
    return (
        session.contended
        and session.agreed == agreement(attempt)
        and not session.tangled
        and not attempt.request.take_over
        and (deadline is None or deadline - now() > _SOONEST)
    )


def wait_and_grant(
    server: Server, session: Session, seconds: float | None, attempt: Attempt[Session, Keys, Ahead]
) -> tuple[bool, PgError | None]:
    """Wait in slot 0's queue, and draw the grant in the same message: (ours, the error).

    The server hands the slot over inside the holder's release, so the grant's statements
    (the fence, the holder's name, the (name, N) lock, the check of N and of takers, the
    LISTEN) and the window's read run as soon as the wait ends: the hand-over costs no
    round trip after the wake (docs/design.md A8). Until this session's next statement
    its comment is the waiter's: `status` dates such a holder from the end of the message
    (pg_stat_activity.state_change). The grant is `attempt.state`; False with the error
    when the wait did not end with the slot ours (`waiting.ran_out` judges it).
    """
    if not attempt.request.shared:  # a writer's fence may need the table made
        fences.make(server, session)
    grant, needed, _ = _statements(server, session, attempt, 0, trying=False)
    key = attempt.key.slots[0]
    answers, error = waiting.queue(server, session, key, 0, seconds, attempt, grant)
    if not answers:  # the wait, or a PREPARE before it, failed: the slot is not ours
        return _not_granted(server, session, seconds, attempt, error)
    session.contended = answers[0] != [("free",)]
    answers = answers[1:]  # the wait's row: the slot is ours
    name(session, attempt, 0)
    attempt.sent = now()  # the lease runs from the answer: the session idles from about then
    if error is not None:
        session.unsure()
    if len(answers) < needed:  # the grant failed after the wait: a round trip of its own
        _learn(server, error)
        attempt.state = _again(server, session, attempt, 0)
        return True, None
    session.listening = channel(attempt.key) if error is None else ""
    drawn = Drawn.read(answers[0], shared=attempt.request.shared)
    attempt.state = Ahead(drawn.fence, Others.read(answers[1]), checked=True)
    session.stopping = False  # the grant let go of a taker's stop key
    if error is not None:  # the window's read failed, and rolled the grant back with it
        modes.unreadable(server, session, error)
        attempt.state = _again(server, session, attempt, 0)
        return True, None
    window = modes.read_window(server, session, key, answers[needed:], None)
    if fences.made_since(server, answers[needed - 1]):  # a transaction id is no fence now
        attempt.state = _again(server, session, attempt, 0)
    if window is not None:
        judge(attempt.state.others, attempt.request)  # another N is said before busy
        modes.sit_out(server, session, attempt, window)
        attempt.sent = attempt.state = None  # `Statements.grant` draws the fence from now
        session.tangled = True  # that grant takes the (name, N) lock once more
    return True, None


def _not_granted(
    server: Server,
    session: Session,
    seconds: float | None,
    attempt: Attempt[Session, Keys, Ahead],
    error: PgError | None,
) -> tuple[bool, PgError | None]:
    """Act on a wait (or a PREPARE before it) that failed: the slot is not ours.

    After news of a fence table (dropped, refused), wait again; else return (False,
    *error*) for `waiting.ran_out` to judge.
    """
    if error is not None and error.sqlstate not in {LOCK_NOT_AVAILABLE, QUERY_CANCELED}:
        session.unsure()
        _learn(server, error)
        return wait_and_grant(server, session, seconds, attempt)
    return False, error


def agreement(attempt: Attempt[Session, Keys, Ahead]) -> tuple[int, int]:
    """Return the shared (name, N) lock that *attempt*'s grant holds: (its key, N)."""
    return attempt.key.agreed, attempt.request.slots


# The grant's parameters: the slot's key, the fence's key (the name's slot 0), the
# application_name, the (name, N) lock's key and N, the stop key.
_PARAMETERS: Final = "bigint, bigint, text, int, int, bigint"


def _fence(server: Server, attempt: Attempt[Session, Keys, Ahead]) -> str:
    """Return the expression of the grant's fence (`fences`): NULL for none."""
    if attempt.request.shared or server.fences == fences.NONE:
        return "NULL"
    if server.fences == fences.TABLE:
        return "(SELECT fence FROM drawn)"
    current = "pg_current_xact_id()::text::bigint" if server.version >= V13 else "txid_current()"
    return f"CASE WHEN got THEN {current} END"


def _steps(server: Server, session: Session, attempt: Attempt[Session, Keys, Ahead]) -> list[str]:
    """Return the grant's expressions: the name, the shared (name, N) lock.

    A taker lets its stop key go: granted, it asks nobody to stop any more. A session
    that holds the (name, N) lock from an earlier grant keeps it, and takes it no more.
    """
    steps = ["set_config('application_name', $3, false)"]
    if session.agreed != agreement(attempt):
        steps.append("pg_try_advisory_lock_shared($4, $5)")
    if session.stopping:
        steps.append("pg_advisory_unlock_shared($6)")
    if server.fences == fences.XACT and server.durable and not attempt.request.shared:
        steps.append("pg_logical_emit_message(true, 'lockrun', '') IS NOT NULL")
    return steps


def _grant(
    server: Server,
    session: Session,
    attempt: Attempt[Session, Keys, Ahead],
    slot: int,
    *,
    trying: bool,
) -> list[str]:
    """Return the grant's statements, whose row `Drawn` reads: got, the fence, the steps.

    A fence from the table is drawn by a data-modifying WITH query, which runs once
    whether or not it is read; its lock_timeout is none (a wait's may be left set). The
    statement is prepared once per session and shape: planning it costs more than running it.
    """
    request = attempt.request
    lock = "pg_try_advisory_lock_shared" if request.shared else "pg_try_advisory_lock"
    taking = f"{lock}($1)" if trying else "true"
    steps = ", ".join(f"CASE WHEN got THEN {step} END" for step in _steps(server, session, attempt))
    fence = _fence(server, attempt)
    if fence.startswith("(SELECT"):
        text = (
            f"WITH try AS (SELECT {taking} AS got, "
            "set_config('lock_timeout', '0', true) OFFSET 0), "
            f"drawn AS ({fences.draw('$2')}) SELECT got, {fence}, {steps} FROM try"
        )
    else:
        text = f"SELECT got, {fence}, {steps} FROM (SELECT {taking} AS got OFFSET 0) AS try"
    keys = attempt.key
    label = session.literal(application_name(request.name, slot))
    values = (keys.slots[slot], keys.slots[0], label, keys.agreed, request.slots, keys.stop)
    return session.prepared(text, _PARAMETERS, ", ".join(map(str, values)))


def _statements(
    server: Server,
    session: Session,
    attempt: Attempt[Session, Keys, Ahead],
    slot: int,
    *,
    trying: bool,
) -> tuple[list[str], int, bool]:
    """Return `draw`'s statements, the number of answers before the window's, the check's.

    `Drawn` reads the first's row; `Others` the second's, if the check of N runs. It
    runs unless a session that holds the (name, N) lock of a proven N tries: a grant
    after a wait runs it for the takers waiting behind (docs/design.md A8). A fallback
    fence (a transaction id) is followed by the question whether the table exists.
    """
    checking = not trying or session.agreed != agreement(attempt)
    xact = server.fences == fences.XACT
    statements = [
        *_grant(server, session, attempt, slot, trying=trying),
        *([others(attempt.key, attempt.request.slots)] if checking else []),
        *([fences.MADE] if xact else []),
        # from the commit on, a taker's NOTIFY rings our bell
        *modes.listen(session, attempt.key),
    ]
    answers = 1 + checking + xact  # PREPARE and LISTEN answer no rows
    if trying:  # in the same transaction, but with a snapshot taken after the try
        statements += modes.window_check(server, session, attempt.key.slots[slot])
    return statements, answers, checking


def draw(
    server: Server,
    session: Session,
    attempt: Attempt[Session, Keys, Ahead],
    slot: int,
    *,
    trying: bool,
) -> tuple[bool, Ahead, Window | None]:
    """Try *slot* (or, not *trying*, count it as held); if ours, draw a fence: one trip.

    Return whether the slot is ours, what the grant learnt (`Ahead`): the fence, the
    live users of another N, read after the shared (name, N) lock was taken (checking
    after taking it catches two users of different N who got in at the same moment, as
    the later check of the two sees the other's lock), and the takers waiting; and, for
    a try that got the slot, its --hold-at-least window, read in a transaction of its
    own that begins after the try (a window committed before the unlock that freed the
    slot is seen).

    The fence comes from the table of fences (`fences`), made on the first grant that
    draws one. A statement that failed may have taken locks: the session is tangled,
    and its release lets go of all it holds.
    """
    if not attempt.request.shared:  # a writer's fence may need the table made
        fences.make(server, session)
    statements, needed, checked = _statements(server, session, attempt, slot, trying=trying)
    session.send_simple(*statements)
    answers, error = results(session, server.timeout)
    if error is not None:
        session.unsure()
    if len(answers) < needed:  # the grant failed, not the window's read
        _learn(server, error)
        session.tangled = True
        return draw(server, session, attempt, slot, trying=trying)  # a held slot: again
    session.listening = channel(attempt.key) if error is None else ""
    drawn = Drawn.read(answers[0], shared=attempt.request.shared)
    ahead = Ahead(drawn.fence, Others.read(answers[1]) if checked else _NOBODY, checked)
    if not drawn.got:
        return False, ahead._replace(fence=None), None
    if error is not None:  # the window's read failed, and rolled the grant back with it
        modes.unreadable(server, session, error)
        return True, _again(server, session, attempt, slot), None
    session.stopping = False  # the grant let go of a taker's stop key
    key = attempt.key.slots[slot]
    window = modes.read_window(server, session, key, answers[needed:], None) if trying else None
    if fences.made_since(server, answers[needed - 1]):  # a transaction id is no fence now
        return True, _again(server, session, attempt, slot), window
    return True, ahead, window


def _learn(server: Server, error: PgError | None) -> None:
    """Learn from a grant's *error* what to draw instead (`fences`), or raise it."""
    if error is None or not (fences.refused(server, error) or server.durable_refused(error)):
        raise error or PgError(NO_ANSWER)


def _again(
    server: Server, session: Session, attempt: Attempt[Session, Keys, Ahead], slot: int
) -> Ahead:
    """Grant a slot that is ours once more, in a round trip of its own: what it learnt.

    The session may now hold its (name, N) lock twice: it is tangled.
    """
    session.tangled = True
    _, ahead, _ = draw(server, session, attempt, slot, trying=False)
    return ahead
