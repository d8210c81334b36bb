"""A PostgreSQL grant in one round trip: the fence, the holder's name, the check of N."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.backends import slots_mismatch
from lockrun.bounds import MAX_SLOTS
from lockrun.timing import now

from . import modes
from .keys import application_name, channel, comment, halves
from .rows import Drawn, Others
from .server import V13
from .session import NO_ANSWER, PgError, results

if TYPE_CHECKING:
    from lockrun.backends import Request
    from lockrun.backends.sessionlock import Attempt

    from .keys import Keys
    from .rows import Window
    from .server import Server
    from .session import Session

_GRANT_ANSWERS: Final = 2  # a grant's statements: the grant, the others (N, takers)


class Ahead(NamedTuple):
    """What a grant's round trip learnt: its fence, and the rows of `lockrun_others`."""

    fence: int | None
    others: Others


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
    if not got:  # nothing was granted: a waiter's statements name a waiter
        attempt.sent = None
        session.tag = attempt.tag
        return False
    if window is not None:
        judge(ahead.others, attempt.request)  # another N is said before busy
        modes.sit_out(server, session, attempt, window)
        attempt.sent = attempt.state = None  # `Statements.grant` draws the fence from now
    return True


def _steps(
    server: Server, session: Session, attempt: Attempt[Session, Keys, Ahead], slot: int
) -> list[str]:
    """Return the grant's expressions: the fence, the name, the shared (name, N) lock.

    A shared holder has no fence (a fence orders writers): NULL in its place. A taker
    lets its stop key go: granted, it asks nobody to stop any more.
    """
    request = attempt.request
    current = "pg_current_xact_id()::text::bigint" if server.version >= V13 else "txid_current()"
    label = session.literal(application_name(request.name, slot))
    steps = [
        "NULL" if request.shared else current,
        f"set_config('application_name', {label}, false)",
        f"pg_try_advisory_lock_shared({attempt.key.agreed}::int, {request.slots}::int)",
    ]
    if session.stopping:
        steps.append(f"pg_advisory_unlock_shared({attempt.key.stop}::bigint)")
    if server.durable and not request.shared:
        steps.append("pg_logical_emit_message(true, 'lockrun', '') IS NOT NULL")
    return steps


def _statements(
    server: Server,
    session: Session,
    attempt: Attempt[Session, Keys, Ahead],
    slot: int,
    *,
    trying: bool,
) -> list[str]:
    """Return `draw`'s statements; `Drawn` and `Others` read the first two's rows."""
    request = attempt.request
    key = attempt.key.slots[slot]
    lock = "pg_try_advisory_lock_shared" if request.shared else "pg_try_advisory_lock"
    taking = f"{lock}({key}::bigint)" if trying else "true"
    steps = ", ".join(
        f"CASE WHEN got THEN {step} END" for step in _steps(server, session, attempt, slot)
    )
    statements = [
        f"SELECT got, {steps} FROM (SELECT {taking} AS got OFFSET 0) AS try",
        others(attempt.key, request.slots),
        # from the commit on, a taker's NOTIFY rings our bell
        *modes.listen(session, attempt.key),
    ]
    if trying:  # in the same transaction, but with a snapshot taken after the try
        statements += modes.window_check(server, session, key)
    return statements


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

    The fence is the id of a transaction of ours, made durable. Transaction ids only
    grow, cluster-wide. A transaction that wrote nothing commits without waiting for
    its record to reach disk, so a crash could hand its id out again; a logical message
    (prefix ``lockrun``) is the smallest write that makes the commit wait for the disk.
    """
    session.send_simple(*_statements(server, session, attempt, slot, trying=trying))
    answers, error = results(session, server.timeout)
    if len(answers) < _GRANT_ANSWERS:  # the grant failed, not the window's read
        if error is None or not server.durable_refused(error):
            raise error or PgError(NO_ANSWER)
        return draw(server, session, attempt, slot, trying=trying)  # a held slot: again
    session.listening = channel(attempt.key) if error is None else ""
    drawn = Drawn.read(answers[0], shared=attempt.request.shared)
    found = Others.read(answers[1])
    if not drawn.got:
        return False, Ahead(None, found), None
    if error is not None:  # the window's read failed, and rolled the grant back with it
        modes.unreadable(server, session, error)
        _, ahead, _ = draw(server, session, attempt, slot, trying=False)  # ours: again
        return True, ahead, None
    session.stopping = False  # the grant let go of a taker's stop key
    answered = answers[_GRANT_ANSWERS:]
    key = attempt.key.slots[slot]
    window = modes.read_window(server, session, key, answered, None) if trying else None
    return True, Ahead(drawn.fence, found), window
