"""MySQL's statement batches, rows and URI helpers, in-process: no server, forged answers.

A co-tenant of the server may write lockrun's tables (rows of any value their columns take,
or of any type once it altered them) and wait with a comment of its own. Whatever it wrote,
a decoder returns a decision or the backend's documented error (78), never another
exception. Each sweep here stands for many end-to-end runs: tests/hostile/test_marks.py and
test_records.py keep one run per kind of forgery.
"""

from __future__ import annotations

import decimal
import json
import math
from typing import TYPE_CHECKING, Any

import pymysql
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun.backends import Holder, Request, parse_uri
from lockrun.backends.mysql import uri as mysql_uri
from lockrun.backends.mysql.batch import Answer, Batch, first_row, last_id, rows, value
from lockrun.backends.mysql.modes import (
    Found,
    MarkRow,
    Mode,
    Modes,
    found_marks,
    mark_kind,
    mark_row,
    mismatch,
)
from lockrun.backends.mysql.records import apart_reads, check_batch, grant_batch, read_grant
from lockrun.backends.mysql.session import Server, said
from lockrun.backends.mysql.statements import (
    GRANT_READS,
    GRANT_READS_N,
    MARKS_OF,
    MAX_HOLD_US,
    MISMATCH,
    NEXT_FENCE,
    RECORD,
    SHARED_MISMATCH,
    comment,
    first_free,
    get_lock,
    lock_key,
)
from lockrun.backends.mysql.status import (
    HolderRow,
    Waiter,
    counted,
    holder_row,
    line_up,
    mark_holder,
    recorded_holder,
    role,
    seats,
    waiter,
)
from lockrun.backends.mysql.uri import address, carries, login, parse
from lockrun.backends.sessionlock import Attempt
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.errors import BackendUnavailable, ConfigError, TakenOver
from lockrun.timing import now
from tests.support.strategies import deep, holder_like, json_values

if TYPE_CHECKING:
    from pathlib import Path

KEY = lock_key("default", "rows")
NOW_US = 1_790_000_000_000_000  # the server's clock, as MARKS_OF's last column reads it
HOLDER = Holder("box", 42, "alice", ("true",))
RECORD_JSON = json.dumps(HOLDER.to_dict())
# What a column may hold once a co-tenant altered the table: anything PyMySQL decodes.
cells = (
    json_values
    | st.decimals(allow_nan=False)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.binary(max_size=20)
    | st.sampled_from(["hold", "r:0123456789abcdef", "r:zz", "stop", "r:"])
)
# The JSON a co-tenant may put in a holder's record: near misses, junk, too deep, too long.
records = (
    st.text(max_size=40)
    | json_values.map(json.dumps)
    | holder_like().map(json.dumps)
    | st.sampled_from([deep(30_000), "ÿ" * 70_000, "null", "'; DROP TABLE lockrun_holders; --"])
)


def request(slots: int = 1, **fields: Any) -> Request:
    """Return a request for the lock of `KEY`."""
    return Request("default", "rows", slots, 10.0, HOLDER)._replace(**fields)


# -- batches ------------------------------------------------------------------------------


def test_a_batch_reads_each_answer_by_the_name_it_was_added_under() -> None:
    """Each reply decodes its own statement's answer, whatever was added before it."""
    batch = Batch()
    begin = batch.add("START TRANSACTION")
    fence = batch.add(NEXT_FENCE, (KEY,), read=last_id)
    stop = batch.add("SELECT IS_USED_LOCK(%s)", (f"{KEY}:stop",), read=value)
    other = batch.add(MISMATCH, (KEY, 1), read=first_row)
    marks = batch.add(MARKS_OF, (KEY, KEY), read=rows)
    batch.answers[:] = [
        Answer((), 0),
        Answer((), 17),
        Answer(((99,),), 0),
        Answer(((3, "{}"), (4, "{}")), 0),
        Answer((("hold",), ("r:",)), 0),
    ]
    assert [sql for sql, _ in batch.statements][:2] == ["START TRANSACTION", NEXT_FENCE]
    assert begin.value is None
    assert fence.value == 17
    assert stop.value == 99
    assert other.value == (3, "{}")
    assert marks.value == (("hold",), ("r:",))
    assert not any(reply.failed for reply in (begin, fence, stop, other, marks))


def test_statements_the_server_never_reached_read_as_no_rows() -> None:
    """After an error the server answers none of the rest: each reads as no row, 0, ()."""
    batch = Batch()
    first = batch.add("SELECT 1", read=value)
    failing = batch.add("SELECT 2", read=value)
    after = batch.add("SELECT 3", read=rows)
    fence = batch.add(NEXT_FENCE, (KEY,), read=last_id)
    batch.answers.append(Answer(((1,),), 0))
    assert first.answered
    assert first.value == 1
    assert failing.failed
    assert not failing.answered
    assert failing.value is None
    assert after.value == ()
    assert not after.failed
    assert fence.value == 0


# -- the check of N and the grant -----------------------------------------------------------


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("slots", [1, 3])
def test_the_grant_sends_its_statements_in_one_order(*, slots: int, gate: bool) -> None:
    """Fence and record in one transaction, the gate's release, then one read (design A7).

    Each write names the slot's lock: it happens only on the session that holds it.
    """
    grant = grant_batch(KEY, request(slots), 2, RECORD_JSON, gate=gate)
    sent = [sql for sql, _ in grant.batch.statements]
    expected = ["START TRANSACTION", NEXT_FENCE, RECORD, "COMMIT"]
    expected += ["SELECT RELEASE_LOCK(%s)"] if gate else []
    expected += [GRANT_READS_N] if slots > 1 else [GRANT_READS]
    assert sent == expected
    slot = f"{KEY}:2"
    assert grant.batch.statements[1][1] == (KEY, slot)
    assert grant.batch.statements[2][1] == (KEY, 2, slots, "default", "rows", RECORD_JSON, slot)
    reads = (f"{KEY}:stop", KEY, slots, KEY) + ((KEY,) if slots > 1 else ())
    assert grant.batch.statements[-1][1] == reads
    # The read may find a table out of reach: the batch may end before it.
    assert {grant.stop.index, grant.other.index, grant.last.index} == {len(sent) - 1}
    assert grant.fence.index == 1


@pytest.mark.parametrize("slots", [1, 3])
def test_reads_apart_go_one_statement_each(slots: int) -> None:
    """Where the one read failed: the stop, the check of N, then the marks or shared holders."""
    apart = apart_reads(KEY, request(slots))
    sent = [sql for sql, _ in apart.batch.statements]
    assert sent == ["SELECT IS_USED_LOCK(%s)", MISMATCH, SHARED_MISMATCH if slots > 1 else MARKS_OF]
    assert (apart.stop.index, apart.other.index, apart.last.index) == (0, 1, 2)


def _granted(grant: Any, reads: tuple[Any, ...] | None) -> None:
    grant.batch.answers[:] = [Answer((), 0), Answer((), 123), Answer((), 1), Answer((), 0)]
    if reads is not None:
        grant.batch.answers.append(Answer((reads,), 0))


def test_a_grant_decodes_its_fence_a_take_over_and_another_n_from_one_row() -> None:
    """Each column lands in its field of `Drawn`: the stop, the other; no marks, nothing found."""
    grant = grant_batch(KEY, request(), 0, RECORD_JSON, gate=False)
    _granted(grant, (77, f"2 {RECORD_JSON}", 0))
    drawn = read_grant(grant, 1, RECORD_JSON)
    assert drawn == (123, (2, RECORD_JSON), Found(stop=77), RECORD_JSON, False)


def test_a_grant_that_finds_marks_leaves_them_to_be_read() -> None:
    """Marks that may count: `found` is None, for `Modes.look` to read them."""
    grant = grant_batch(KEY, request(), 0, RECORD_JSON, gate=False)
    _granted(grant, (None, None, 1))
    assert read_grant(grant, 1, RECORD_JSON) == (123, None, None, RECORD_JSON, False)


def test_a_grant_of_n_decodes_a_live_shared_holder_as_a_user_of_one_slot() -> None:
    """N > 1: the third column is a shared holder's record, refused as a user of 1."""
    grant = grant_batch(KEY, request(3), 1, RECORD_JSON, gate=True)
    grant.batch.answers[:] = [Answer((), 0), Answer((), 9), Answer((), 1), Answer((), 0)]
    grant.batch.answers += [Answer(((1,),), 0), Answer(((None, None, f"1 {RECORD_JSON}"),), 0)]
    assert read_grant(grant, 3, RECORD_JSON) == (9, (1, RECORD_JSON), Found(), RECORD_JSON, False)


def test_reads_apart_decode_the_marks() -> None:
    """The reads one by one: the stop, another N's row, the window of the marks' rows."""
    apart = apart_reads(KEY, request())
    apart.batch.answers[:] = [Answer(((77,),), 0), Answer(((2, RECORD_JSON),), 0)]
    apart.batch.answers.append(Answer((("hold", 5, 2_000_000, None, "{}", NOW_US),), 0))
    drawn = read_grant(apart, 1, RECORD_JSON, 123)
    assert drawn == (123, (2, RECORD_JSON), Found(stop=77, window=2.0), RECORD_JSON, False)


def test_a_grant_whose_reads_found_no_table_finds_nothing() -> None:
    """Answers up to the gate's release only: no other N, no marks, the fence drawn."""
    grant = grant_batch(KEY, request(3), 1, RECORD_JSON, gate=True)
    grant.batch.answers[:] = [Answer((), 0), Answer((), 9), Answer((), 1), Answer((), 0)]
    grant.batch.answers += [Answer(((1,),), 0)]
    drawn = read_grant(grant, 3, RECORD_JSON)
    assert drawn == (9, None, Found(), RECORD_JSON, False)
    assert not grant.other.answered


@given(
    st.integers(min_value=1, max_value=MAX_SLOTS),
    records,
    st.lists(st.lists(cells, max_size=7).map(tuple) | cells, max_size=6),
    st.none() | st.integers(min_value=0, max_value=2**64 - 1),
)
def test_any_grant_answers_a_co_tenant_can_forge_are_a_decision(
    other_slots: int, record: str, marks: list[Any], stop: int | None
) -> None:
    """Any rows of theirs: a grant, a wait or a take-over, or another N refused with 78."""
    grant = apart_reads(KEY, request())
    grant.batch.answers[:] = [Answer(((stop,),), 0), Answer(((other_slots, record),), 0)]
    grant.batch.answers.append(Answer(tuple(marks), 0))
    drawn = read_grant(grant, 1, RECORD_JSON, 5)
    assert drawn.found is not None
    assert 0 <= drawn.found.window <= MAX_WAIT
    assert drawn.found.stop == stop
    assert drawn.other is not None
    refused = mismatch(request(), drawn.other)
    assert isinstance(refused, ConfigError)
    assert refused.exit_code == 78
    assert f"in use with {other_slots} slot" in str(refused)


@pytest.mark.parametrize(
    "record",
    [deep(30_000), '{"pid": "x", "host": [], "user": null}', "ÿ" * 30_000, "null"],
    ids=["deep", "types", "huge", "null"],
)
def test_a_live_holder_of_another_n_with_a_junk_record_is_refused_without_it(record: str) -> None:
    """--slots 4 against a row of 2 with junk JSON: 78, said without a holder."""
    refused = mismatch(request(4), (2, record))
    assert refused.exit_code == 78
    assert str(refused).startswith("in use with 2 slots, but this one asks for 4 slots")


def test_a_junk_free_record_of_another_n_names_its_holder() -> None:
    """The holder's own record names it: user@host pid."""
    assert "by alice@box pid 42" in str(mismatch(request(), (3, RECORD_JSON)))


@pytest.mark.parametrize("slots", [1, 4])
def test_the_check_of_n_goes_before_the_try_and_finds_shared_holders_for_n_over_1(
    slots: int,
) -> None:
    """MISMATCH, the try, then (N > 1) a live shared holder; the first found is refused."""
    try_now = first_free(KEY, slots)
    check = check_batch(KEY, slots, try_now)
    expected = [MISMATCH, try_now] + ([SHARED_MISMATCH] if slots > 1 else [])
    assert [sql for sql, _ in check.batch.statements] == expected
    check.batch.answers[:] = [Answer((), 0), Answer(((0,),), 0)]
    assert check.found() is None
    assert check.tried.value == 0
    if slots > 1:
        check.batch.answers.append(Answer(((1, RECORD_JSON),), 0))
        assert check.found() == (1, RECORD_JSON)
    check.batch.answers[0] = Answer(((2, "{}"),), 0)
    assert check.found() == (2, "{}")


def test_a_try_names_hex_locks_only_and_waits_for_whole_milliseconds() -> None:
    """GET_LOCK's name and timeout are ours; the waiter's tag follows, JSON with no */."""
    req = request(2, holder=HOLDER._replace(host="*/ DROP"))
    tag = comment(req, "t")
    assert get_lock(f"{KEY}:gate", 1.23456, tag) == f"SELECT GET_LOCK('{KEY}:gate', 1.235) {tag}"
    assert tag.count("*/") == 1
    assert tag.endswith(" */")


# -- rows of lockrun_marks -------------------------------------------------------------------


@given(st.lists(st.lists(cells, max_size=7).map(tuple) | cells, max_size=8), cells)
def test_any_rows_of_marks_decode_to_a_bounded_window(rows_: list[Any], stop: object) -> None:
    """Whatever the rows hold, the decoder returns a window in [0, a year] and hex readers."""
    found = found_marks(rows_, stop)
    assert 0 <= found.window <= MAX_HOLD_US / 1e6 <= MAX_WAIT
    assert all(len(mark) == 18 and mark.startswith("r:") for mark in found.readers)


def test_a_window_read_back_is_cut_to_the_longest_hold() -> None:
    """Microseconds past a year (a forged until), or not a number: no window longer than that."""
    for left in (2**62, decimal.Decimal("1e30"), -5, float("inf"), "9" * 30, None, True):
        window = found_marks([("hold", 1, left, None)]).window
        assert 0 <= window <= MAX_WAIT


# Rows as MARKS_OF returns forged ones: (mark, connection, µs left, live, holder, now).
@pytest.mark.parametrize(
    ("row", "kind", "found"),
    [
        (("hold", 424242, MAX_HOLD_US, None, "{}", NOW_US), "window", Found(window=MAX_WAIT)),
        (("hold", 424242, 0, None, "not json", NOW_US), "window", Found()),
        (("r:0123456789abcdef", 424242, 0, 0, "{}", NOW_US), "ended", Found(swept=True)),
        (("r:zz", 424242, 0, None, "'; DROP --", NOW_US), "ended", Found(swept=True)),
        (("r:", 424242, 0, None, "ÿ" * 100, NOW_US), "ended", Found(swept=True)),
        (("r:0123456789abcdef0123", 1, 0, None, "{}", NOW_US), "ended", Found(swept=True)),
        (("r:00000000deadbeef", 7, 0, 1, '{"pid": -1}', NOW_US), "reader", None),
        (("stop", 424242, 0, None, "*/ SELECT 1 /*", NOW_US), "other", Found()),
    ],
    ids=[
        "hold-max",
        "hold-junk",
        "reader-ended",
        "reader-sql",
        "reader-short",
        "reader-long",
        "reader-live",
        "stop",
    ],
)
def test_forged_rows_of_marks_count_for_what_they_prove(
    row: tuple[Any, ...], kind: str, found: Found | None
) -> None:
    """A window is cut to a year, a reader counts only while live and ours, the rest is junk."""
    decoded = mark_row(row)
    assert decoded is not None
    assert mark_kind(decoded) == kind
    expected = found or Found(readers=("r:00000000deadbeef",))
    assert found_marks([row]) == expected


def test_what_is_no_row_of_marks_decodes_to_none() -> None:
    """Fewer columns than the decision needs, or not a row: nothing."""
    assert mark_row(("hold", 1, 5)) is None
    assert mark_row("hold") is None
    assert mark_row(("hold", 1, 5, None)) == MarkRow("hold", 1, 5e-6, False, None, None)  # noqa: FBT003
    assert mark_row((b"hold", 1, 5, 1)) == MarkRow("", 1, 5e-6, True, None, None)  # noqa: FBT003


@given(st.lists(cells, min_size=6, max_size=6).map(tuple))
def test_any_row_of_marks_adds_a_holder_or_none(row: tuple[Any, ...]) -> None:
    """`status` shows a window's run until at most a year on, or a shared holder; else none."""
    decoded = mark_row(row)
    assert decoded is not None
    holder = mark_holder(decoded._replace(server_now=NOW_US))
    if holder is not None:
        assert holder.slot == 0
        assert holder.shared or holder.until is not None
        assert holder.until is None or holder.until <= NOW_US / 1e6 + MAX_WAIT


def test_a_window_of_marks_is_shown_until_it_ends_and_a_reader_as_shared() -> None:
    """The window's end on the server's clock; a record that is none names the session."""
    window = mark_holder(MarkRow("hold", 9, 2.5, False, RECORD_JSON, NOW_US))  # noqa: FBT003
    assert window == HOLDER._replace(slot=0, until=NOW_US / 1e6 + 2.5)
    reader = mark_holder(MarkRow("r:00000000deadbeef", 9, 0.0, True, "junk", NOW_US))  # noqa: FBT003
    assert reader == Holder("? (connection 9)", 0, "?", (), slot=0, shared=True)
    assert mark_holder(MarkRow("hold", 9, 0.0, False, RECORD_JSON, NOW_US)) is None  # noqa: FBT003
    assert mark_holder(MarkRow("hold", 9, 1.0, False, RECORD_JSON, "now")) is None  # noqa: FBT003


@given(records, cells)
def test_any_record_of_a_mark_names_a_holder(record: str, connection: object) -> None:
    """A record that is none names the session instead; it never raises."""
    assert isinstance(recorded_holder(record, connection), Holder)


# -- rows of lockrun_holders and the processlist --------------------------------------------------


@given(st.lists(cells, max_size=6))
def test_any_row_of_holders_decodes_or_is_none(row: list[Any]) -> None:
    """Columns of any type (an altered table): a typed row, or none of ours."""
    decoded = holder_row(row)
    assert decoded is None or isinstance(decoded.record, str)


def test_a_row_of_holders_decodes_to_its_columns() -> None:
    """slot, slots, connection, holder: in `HOLDERS_OF`'s order."""
    assert holder_row((1, 3, 77, RECORD_JSON)) == HolderRow(1, 3, 77, RECORD_JSON)
    assert holder_row((decimal.Decimal(1), "3", 77, b"{}")) == HolderRow(1, 3, 77, "b'{}'")
    assert holder_row(("x", 3, 77, "{}")) is None
    assert holder_row((math.inf, 3, 77, "{}")) is None


def test_counted_keeps_only_the_n_lockrun_could_have_written() -> None:
    """--slots 4e9 in a row is anyone's: not counted; marks make a lock of one slot."""
    rows_ = [HolderRow(0, 4_000_000_000, 1, "{}"), HolderRow(1, 3, 2, "{}")]
    queue = [waiting("gate", slots=5)]
    assert counted(rows_, queue, marked=False) == {3, 5}
    assert counted(rows_[:1], [], marked=False) == set()
    assert counted(rows_[:1], [], marked=True) == {1}


@given(st.dictionaries(st.integers(0, 3), records, max_size=4))
def test_a_slot_is_named_by_its_record_only_if_the_record_is_its_session_s(
    written: dict[int, str],
) -> None:
    """A junk record, or one another session wrote, leaves the processlist to say who."""
    by_slot = {slot: HolderRow(slot, 4, 100 + slot, record) for slot, record in written.items()}
    by_slot[3] = HolderRow(3, 4, 999, RECORD_JSON)  # another session's record
    found = seats([100, None, 102, 103], by_slot, [waiting("2", connection=102)])
    assert [(seat.slot, seat.connection) for seat in found] == [(0, 100), (3, 103)]
    assert found[1].holder is None
    if found[0].holder is not None:
        assert found[0].holder.slot == 0


def test_a_slot_whose_record_is_its_session_s_is_named_by_it() -> None:
    """Our record of the session that holds the slot: user@host, with the slot."""
    (seat,) = seats([7], {0: HolderRow(0, 1, 7, RECORD_JSON)}, [])
    assert seat.holder == HOLDER._replace(slot=0)


def waiting(part: str, *, connection: int = 1, person: str = "t", slots: int = 4) -> Waiter:
    """Return a waiter on *part* of `KEY`; *person* is its token."""
    return Waiter(connection, f"{KEY}:{part}", person, "default", "rows", slots, HOLDER)


def test_the_head_waits_on_slots_and_is_shown_first_once() -> None:
    """The head's lines (one per slot) come first, as one person; the gate's after."""
    queue = [
        waiting("gate", person="b", connection=2),
        waiting("0", person="a"),
        waiting("1", person="a"),
        waiting("gate", person="c", connection=3),
    ]
    assert [role(each) for each in queue] == ["queued", "head", "head", "queued"]
    assert len(line_up(queue)) == 3
    assert line_up([waiting("stop"), waiting("gate", person="x")]) == (HOLDER, HOLDER)


@pytest.mark.parametrize(
    "forged",
    [
        '{"token": 1, "slots": "x"}',
        deep(50_000),
        (
            '{"token": "t", "namespace": "default", "name": "rows", "slots": 99999,'
            ' "holder": {"host": "h", "pid": 1, "user": "u"}}'
        ),
    ],
    ids=["types", "deep", "slots"],
)
def test_a_forged_comment_in_the_processlist_is_no_waiter(forged: str) -> None:
    """Another session's /* lockrun {junk} */ comment: not a waiter of ours."""
    info = f"SELECT GET_LOCK('{KEY}:0', 30) /* lockrun {forged} */"
    assert waiter((5, 1000, info)) is None


def test_a_waiter_s_own_comment_decodes_to_who_waits_for_what() -> None:
    """The comment `comment` writes: the connection, its lock and its identity."""
    tag = comment(request(3), "token")
    assert waiter((5, 0, get_lock(f"{KEY}:gate", 2.0, tag))) == Waiter(
        5, f"{KEY}:gate", "token", "default", "rows", 3, HOLDER
    )
    sleeping = f"SELECT SLEEP(0.500) AS '{KEY}:0' {tag}"
    assert waiter((6, 0, sleeping)) == Waiter(6, f"{KEY}:0", "token", "default", "rows", 3, HOLDER)


@given(records | st.text(max_size=200), st.sampled_from(["0", "gate", "stop", "9"]))
def test_any_statement_in_the_processlist_is_a_waiter_or_none(text: str, part: str) -> None:
    """A statement of anyone's, with or without a comment like ours: never an exception."""
    for info in (text, f"SELECT GET_LOCK('{KEY}:{part}', 1.000) /* lockrun {text} */"):
        found = waiter((5, 0, info))
        assert found is None or 1 <= found.slots <= MAX_SLOTS


# -- the URI ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mysql://db", {"user": None, "password": "", "database": None}),
        ("mysql://ci:pw:more@db/ci", {"user": "ci", "password": "pw:more", "database": "ci"}),
        (
            "mysql://u%40corp:p%3Aw@db/d%C3%A4ta",
            {"user": "u@corp", "password": "p:w", "database": "däta"},
        ),
    ],
)
def test_login_reads_user_password_and_database(text: str, expected: dict[str, object]) -> None:
    """Percent-decoded; a password may hold colons; no database: None."""
    assert login(parse_uri(text)) == expected


def test_login_refuses_a_path_of_more_than_a_database() -> None:
    """db/app/more is no database name: 78, the URI's form."""
    with pytest.raises(ConfigError, match=r"expected mysql://\[USER"):
        login(parse_uri("mysql://u:secret@db/app/more"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mysql:///app?unix_socket=/run/my.sock", {}),
        ("mysql://db.internal/app", {"host": "db.internal"}),
        ("mysql://[::1]:3307/app", {"host": "::1", "port": 3307}),
    ],
)
def test_address_leaves_out_what_the_uri_does_not_name(
    text: str, expected: dict[str, object]
) -> None:
    """No host: the option file's or the socket; no port: the option file's, else 3306."""
    assert address(parse_uri(text)) == expected


def test_a_name_the_charset_cannot_carry_is_refused_before_any_statement() -> None:
    """latin1 has no 名: 78 naming the charset; utf8mb4 carries it."""
    carries(parse(parse_uri("mysql://db/app")), "default", "名")
    with pytest.raises(ConfigError, match="charset latin1 cannot carry the name '名'"):
        carries(parse(parse_uri("mysql://db/app?charset=latin1")), "default", "名")


def test_an_option_file_that_does_not_parse_is_refused_naming_its_line_not_its_text(
    tmp_path: Path,
) -> None:
    """An option before any [section]: 78 naming the file and line, none of its text."""
    cnf = tmp_path / "broken.cnf"
    cnf.write_text("password=QXZJKWV\n[client]\nuser=app\n")
    with pytest.raises(ConfigError) as raised:
        parse(parse_uri(f"mysql://db/app?read_default_file={cnf}"))
    assert f"read_default_file {cnf} line 1: not a MySQL option file" in str(raised.value)
    assert "QXZJKWV" not in str(raised.value)


# -- what a grant does with what it found (the modes' decisions) ----------------------------------


class FakeSession:
    """A session whose statements are recorded and answered from a script, first match wins."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.sent: list[str] = []

    def one(self, sql: str, args: object = None, *, timeout: float | None = 0) -> Any:  # noqa: ARG002
        row = self.row(sql, args)
        return None if row is None else row[0]

    def row(self, sql: str, args: object = None, *, timeout: float | None = 0) -> Any:  # noqa: ARG002
        self.sent.append(sql)
        return next((row for start, row in self.answers.items() if sql.startswith(start)), None)

    def run(self, batch: Batch) -> None:
        batch.answers.clear()
        for sql, args in batch.statements:
            row = self.row(sql, args)
            batch.answers.append(Answer(() if row is None else (row,), 0))


def fake(answers: dict[str, Any]) -> Any:
    """Return a `FakeSession` typed as the session it stands in for."""
    return FakeSession(answers)


def modes_and_attempt(
    deadline: float | None, **fields: Any
) -> tuple[Modes, Attempt[Any, str, Mode]]:
    """Return the modes of a server never reached, and an attempt on `KEY` until *deadline*."""
    settings = parse(parse_uri("mysql://db/app"))
    server = Server(settings, 30.0, lambda _line: None, lambda part: BackendUnavailable(str(part)))
    return Modes(server), Attempt(request(**fields), KEY, "token", "/* tag */", deadline)


def test_a_take_over_asked_after_this_attempt_makes_it_give_way_or_be_busy() -> None:
    """Found a stop lock: a waiter gives way naming the taker; a try past its deadline is busy."""
    modes, attempt = modes_and_attempt(None)
    session = fake({"SELECT holder FROM lockrun_marks": (RECORD_JSON,)})
    with pytest.raises(TakenOver, match="taken over by alice@box pid 42"):
        modes.settle(session, attempt, f"{KEY}:0", Found(stop=7))
    modes, attempt = modes_and_attempt(0.0)
    assert not modes.settle(fake({}), attempt, f"{KEY}:0", Found(stop=7))


def test_a_window_is_slept_out_on_the_server_unless_the_deadline_comes_first() -> None:
    """A window shorter than the wait: SLEEP holding slot 0, then a new look; longer: busy."""
    modes, attempt = modes_and_attempt(now() + 3600)
    session = fake({"SELECT IS_USED_LOCK": (None,)})
    assert modes.settle(session, attempt, f"{KEY}:0", Found(window=0.01))
    assert session.sent[0].startswith(f"SELECT SLEEP(0.010) AS '{KEY}:0' /* tag */")
    modes, attempt = modes_and_attempt(now() + 1)
    assert not modes.settle(fake({}), attempt, f"{KEY}:0", Found(window=60.0))


def test_shared_holders_are_waited_for_by_an_exclusive_request_only() -> None:
    """Each reader's lock is waited for, then let go; a shared request enters beside them."""
    reader = "r:00000000deadbeef"
    modes, attempt = modes_and_attempt(None)
    session = fake({"SELECT GET_LOCK": (1,), "SELECT IS_USED_LOCK": (None,)})
    assert modes.settle(session, attempt, f"{KEY}:0", Found(readers=(reader,)))
    assert session.sent[:2] == [
        f"SELECT GET_LOCK('{KEY}:{reader}', 31536000.000) /* tag */",
        "SELECT RELEASE_LOCK(%s)",
    ]
    modes, attempt = modes_and_attempt(None, shared=True)
    quiet = fake({})
    assert modes.settle(quiet, attempt, f"{KEY}:0", Found(readers=(reader,)))
    assert quiet.sent == []


def test_a_taker_ends_a_window_and_its_stop_request_unless_a_newer_taker_got_it() -> None:
    """A taker deletes the window and lets KEY:stop go; a newer taker in the release wins."""
    modes, attempt = modes_and_attempt(None, take_over=True)
    session = fake({"SELECT IS_USED_LOCK": (None,)})
    attempt.state = Mode()
    attempt.state.stop = session
    assert modes.settle(session, attempt, f"{KEY}:0", Found(window=5.0))
    assert session.sent[0].startswith("DELETE FROM lockrun_marks WHERE lock_key = %s AND mark")
    assert session.sent[-2:] == ["SELECT RELEASE_LOCK(%s)", "SELECT IS_USED_LOCK(%s)"]
    assert attempt.state.stop is None
    newer = fake({"SELECT IS_USED_LOCK": (99,), "SELECT holder": (RECORD_JSON,)})
    attempt.state.stop = newer
    with pytest.raises(TakenOver, match="taken over by alice@box pid 42"):
        modes.settle(newer, attempt, f"{KEY}:0", Found())


@given(
    kind=st.sampled_from(
        [pymysql.err.InterfaceError, pymysql.err.OperationalError, pymysql.err.InternalError]
    ),
    code=st.integers(0, 5000),
    text=st.sampled_from(["", " ", "\n\t", "()"]),
)
def test_an_error_that_says_nothing_still_gets_a_line_that_does(
    kind: type[pymysql.err.Error], code: int, text: str
) -> None:
    """PyMySQL's `InterfaceError(0, '')` (a closed connection used) is no empty line.

    "lockrun: NAME: URI: " with nothing after it was seen under load (issue 32's CI run).
    """
    settings = mysql_uri.parse(parse_uri("mysql://u:sekrit@db/x"))
    said_text = said(settings, kind(code, text))
    assert said_text.strip("() ")
    assert "sekrit" not in said_text
    assert said(settings, kind()).strip()
