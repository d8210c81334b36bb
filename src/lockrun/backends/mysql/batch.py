"""Named statement batches: several statements in one round trip, each answer read by name.

A grant is one round trip (docs/design.md A7), so its statements go to the server as one
batch. Each is named where it is added, with how its answer is read, so that adding a
statement shifts no index: ``fence = batch.add(NEXT_FENCE, (key,), read=last_id)``, then,
once the batch ran, ``fence.value``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Generic, NamedTuple, TypeVar, overload

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")


class Answer(NamedTuple):
    """What the server answered to one statement of a batch."""

    rows: tuple[Any, ...]
    last_id: int  # LAST_INSERT_ID() as the statement's OK packet reported it


NO_ANSWER: Final = Answer((), 0)  # what a statement the batch never reached reads as


def value(answer: Answer) -> Any:  # noqa: ANN401 - a column's value
    """Return the first column of the first row; None if there is no row."""
    return answer.rows[0][0] if answer.rows and answer.rows[0] else None


def first_row(answer: Answer) -> tuple[Any, ...] | None:
    """Return the first row; None if there is none."""
    if not answer.rows:
        return None
    row: tuple[Any, ...] = answer.rows[0]
    return row


def rows(answer: Answer) -> tuple[Any, ...]:
    """Return every row."""
    return answer.rows


def last_id(answer: Answer) -> int:
    """Return LAST_INSERT_ID() as the statement left it."""
    return answer.last_id


def nothing(answer: Answer) -> None:
    """Read nothing: START TRANSACTION, COMMIT, a write whose effect is all."""


class Reply(Generic[T]):
    """One statement's place in a batch, and its answer read as the statement needs."""

    __slots__ = ("batch", "index", "read")

    def __init__(self, batch: Batch, index: int, read: Callable[[Answer], T]) -> None:
        """Name statement *index* of *batch*, whose answer *read* decodes."""
        self.batch = batch
        self.index = index
        self.read = read

    @property
    def answered(self) -> bool:
        """Whether the server answered this statement (it stops at the first error)."""
        return self.index < len(self.batch.answers)

    @property
    def failed(self) -> bool:
        """Whether the server answered every statement before this one, and stopped here."""
        return self.index == len(self.batch.answers)

    @property
    def value(self) -> T:
        """Return the answer, read; a statement not answered reads as no rows."""
        answers = self.batch.answers
        return self.read(answers[self.index] if self.answered else NO_ANSWER)


class Batch:
    """Statements to run in one round trip, in the order they are added."""

    def __init__(self) -> None:
        """Start empty."""
        self.statements: list[tuple[str, object]] = []  # (sql, args), args escaped by the driver
        self.answers: list[Answer] = []  # one for each statement the server answered

    @overload
    def add(self, sql: str, args: object = None) -> Reply[None]: ...

    @overload
    def add(self, sql: str, args: object = None, *, read: Callable[[Answer], T]) -> Reply[T]: ...

    def add(
        self, sql: str, args: object = None, *, read: Callable[[Answer], Any] = nothing
    ) -> Reply[Any]:
        """Add *sql* with *args*; return its name, whose value *read* makes of the answer."""
        self.statements.append((sql, args))
        return Reply(self, len(self.statements) - 1, read)
