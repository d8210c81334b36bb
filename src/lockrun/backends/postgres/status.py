"""`lockrun status` on PostgreSQL: pg_locks beside pg_stat_activity, and the open windows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from lockrun.backends import MAX_RECORD, Holder, LockState
from lockrun.bounds import MAX_WAIT

from .keys import Keys, application_name, tagged
from .rows import (
    AdvisoryRow,
    Counted,
    Heading,
    Holding,
    OpenWindow,
    Queued,
    advisory_statement,
    held_over,
    open_windows,
    role,
)
from .server import V14, WINDOWS
from .session import results

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .server import Server
    from .session import Session

_PROBED_SLOTS: Final = 64  # `status` looks at this many slots when it cannot learn N
_WINDOWS_SHOWN: Final = 10000  # `status` reads at most this many open windows


def states(server: Server, session: Session, namespace: str, name: str | None) -> list[LockState]:
    """Report holders and waiters of *name*, or of every lock in *namespace*."""
    windows = _windows(server, session)
    if name is not None:
        return [_state(server, session, namespace, name, windows)]
    names = _names(server, session, namespace, windows)
    states = [_state(server, session, namespace, each, windows) for each in sorted(names)]
    return [state for state in states if state.holders or state.waiters]


def _names(
    server: Server, session: Session, namespace: str, windows: dict[int, OpenWindow]
) -> set[str]:
    """Return the names of *namespace* that a statement's comment or a window names."""
    rows = session.rows(
        "SELECT query FROM pg_stat_activity WHERE query LIKE '%/* lockrun {%' "
        "AND pid <> pg_backend_pid()",
        timeout=server.timeout,
    )
    found = [tagged(row[0] or "") for row in rows]
    found += [who for who, _ in windows.values()]
    return {who.name for who in found if who is not None and who.namespace == namespace}


def _windows(server: Server, session: Session) -> dict[int, OpenWindow]:
    """Read every open --hold-at-least window: key → (the run, as its row says; its end).

    Anyone may write the table: a row is read as untrusted, its end cut to `MAX_WAIT`
    from now, and a table that cannot be read shows no window (status never fails).
    """
    if not server.windows:
        return {}
    session.send_simple(
        f"SELECT key::text, extract(epoch FROM least(until, clock_timestamp() + "
        f"interval '{int(MAX_WAIT)} seconds')), left(holder::text, {MAX_RECORD}) "
        f"FROM {WINDOWS} WHERE until > clock_timestamp() LIMIT {_WINDOWS_SHOWN}"
    )
    answers, error = results(session, server.timeout)
    return open_windows(answers[0] if error is None and answers else [])


def _state(
    server: Server,
    session: Session,
    namespace: str,
    name: str,
    windows: dict[int, OpenWindow],
) -> LockState:
    """Read one lock from pg_locks and pg_stat_activity: who holds which slot, who waits.

    A run's --hold-at-least window is a holder with `until`; a session that waits one
    out holds slot 0 meanwhile and is shown as the first waiter. Shared holders and
    waiters are told by pg_locks' mode, not by their comments.
    """
    keys = Keys(namespace, name, _PROBED_SLOTS)
    slots = {key: slot for slot, key in enumerate(keys.slots)}
    rows = session.rows(
        advisory_statement(waitstart=server.version >= V14),
        "{" + ",".join(map(str, [*keys.slots, keys.gate])) + "}",
        keys.agreed,
        timeout=server.timeout,
    )
    window = windows.get(keys.slots[0])
    sitting = application_name(name, "waiting") if window is not None else None
    line = Line.of((AdvisoryRow.read(row) for row in rows), slots, sitting)
    holders = line.holders
    if window is not None:
        holders.insert(0, held_over(window, namespace, name, WINDOWS))
        line.known.add(1)
    n = max(line.known, default=None)
    where = f"advisory key {keys.slots[0]}" + (f", gate {keys.gate}" if n and n > 1 else "")
    return LockState(namespace, name, where, n, tuple(holders), line.waiters)


class Line:
    """Who holds a lock and who waits for it, in order, from its rows (`rows.role`)."""

    def __init__(self) -> None:
        """Start with no one."""
        self.known: set[int] = set()  # the N that users of the name said or showed
        self.holders: list[Holder] = []
        self.head: dict[str, Holder] = {}  # the gate's holder, waiting on the slots
        self.queue: dict[str, Holder] = {}  # waiting on the gate or on slot 0 (N = 1)

    @classmethod
    def of(cls, rows: Iterable[AdvisoryRow], slots: dict[int, int], sitting: str | None) -> Line:
        """Sort *rows* (slot keys in *slots*: key → slot; others are the gate's)."""
        line = cls()
        for row in rows:
            line.add(row, role(row, slots.get(row.key), sitting))
        return line

    def add(self, row: AdvisoryRow, found: Holding | Heading | Queued | Counted) -> None:
        """Put *row*'s session where `rows.role` *found* it."""
        if row.who is not None:
            self.known.add(row.who.slots)
        match found:
            case Counted(slots=int(slots)):
                self.known.add(slots)
            case Holding(holder=holder):
                self.holders.append(holder)
            case Heading(token=token, holder=holder, first=True):
                self.head = {token: holder} | self.head  # waits out the window, first in line
            case Heading(token=token, holder=holder):
                self.head.setdefault(token, holder)
            case Queued(token=token, holder=holder):
                self.queue.setdefault(token, holder)

    @property
    def waiters(self) -> tuple[Holder, ...]:
        """Return the head of the line, then those queued behind it."""
        queued = (holder for token, holder in self.queue.items() if token not in self.head)
        return (*self.head.values(), *queued)
