"""PostgreSQL's rows decoded and classified in-process: forged rows, no server.

Every text column here is something another client of the server can shape (a statement's
comment, an application_name, a row of lockrun_holds): decoding must give a named value
or the documented refusal, never another exception.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lockrun.backends import Holder, Request
from lockrun.backends.postgres.keys import application_name, comment
from lockrun.backends.postgres.rows import (
    AdvisoryRow,
    Check,
    Counted,
    Drawn,
    Heading,
    Holding,
    Others,
    Queued,
    StopRow,
    Window,
    held_over,
    open_windows,
    parse_window,
    role,
    stop_taken,
    taker,
)
from lockrun.backends.postgres.server import WINDOWS, Setup
from lockrun.backends.postgres.status import Line
from lockrun.bounds import MAX_WAIT
from tests.support.strategies import holder_like

ME = Holder("host-a", 101, "alice", ("job",), since=1.0)


def tag(name: str = "x", slots: int = 1, run: str = "tok", holder: Holder = ME) -> str:
    """Return the comment a lockrun waiting for *name* puts on its statements."""
    return comment(Request("default", name, slots, 5.0, holder), run, holder) + " SELECT 1"


def advisory(
    *,
    subid: str = "1",
    key: str = "11",
    objid: str = "0",
    granted: str = "t",
    pid: str = "4242",
    query: str | None = None,
    mode: str = "ExclusiveLock",
    label: str | None = "lockrun",
    changed: str | None = None,
) -> tuple[str | None, ...]:
    """Return a row of the status statement, in its 13 columns."""
    return (subid, key, objid, granted, pid, None, "bob", "10.0.0.9", "1700000000.5", query,
            mode, label, changed)  # fmt: skip


# -- status rows ---------------------------------------------------------------------------


def test_an_advisory_row_is_read_by_name() -> None:
    """The 13 columns become named fields: booleans, ints and the comment's identity."""
    row = AdvisoryRow.read(advisory(granted="f", query=tag(slots=3), mode="ShareLock"))
    assert (row.counter, row.key, row.granted, row.shared, row.pid) == (
        False,
        11,
        False,
        True,
        "4242",
    )
    assert row.who is not None
    assert (row.who.slots, row.token, row.holder.host, row.holder.shared) == (
        3,
        "tok",
        "host-a",
        True,
    )


def test_a_session_of_another_role_is_described_by_the_server() -> None:
    """No comment to read: its client, backend pid, role and start, and its pid as token."""
    row = AdvisoryRow.read(advisory(query="SELECT pg_advisory_lock(11)"))
    assert row.who is None
    assert row.token == row.pid
    assert row.holder == Holder("10.0.0.9 (backend 4242)", 0, "bob", (), since=1700000000.5)


@pytest.mark.parametrize(
    ("objid", "slots"), [("3", 3), ("0", None), ("65536", None), ("4294967295", None)]
)
def test_a_name_and_n_lock_counts_only_an_n_a_lockrun_could_use(
    objid: str, slots: int | None
) -> None:
    """Anyone may take (key, N): an N outside 1 … MAX_SLOTS is not counted."""
    row = AdvisoryRow.read(advisory(subid="2", objid=objid))
    assert role(row, None, None) == Counted(slots)


def test_granted_rows_are_holders_of_their_slot() -> None:
    """A granted slot is a holder of that slot, in the mode pg_locks shows."""
    row = AdvisoryRow.read(advisory(query=tag(), mode="ShareLock"))
    assert role(row, 2, None) == Holding(ME._replace(slot=2, shared=True))


def test_the_gate_holder_is_not_listed_by_its_gate() -> None:
    """Holding the gate says nothing to show: the head shows by its wait for a slot."""
    assert role(AdvisoryRow.read(advisory(query=tag(slots=2))), None, None) == Counted(None)


def test_a_session_that_waits_out_a_window_heads_the_line() -> None:
    """Slot 0 held under the waiting name while a window is open: first waiter, not holder."""
    sitting = application_name("x", "waiting")
    row = AdvisoryRow.read(advisory(query=tag(), label=sitting))
    assert role(row, 0, sitting) == Heading("tok", ME, first=True)
    assert role(row, 0, None) == Holding(ME._replace(slot=0))  # no window open: a holder
    assert role(row, 1, sitting) == Holding(ME._replace(slot=1))


@pytest.mark.parametrize(
    ("query", "slot", "expected"),
    [
        (tag(slots=3), None, Queued),  # waits for the gate
        (tag(slots=1), 0, Queued),  # one slot: no gate, the slot is the queue
        (None, 0, Queued),  # a stranger: its N is unknown
        (tag(slots=3), 1, Heading),  # holds the gate, waits for the slots
    ],
)
def test_waiting_rows_queue_or_head_the_line(
    query: str | None, slot: int | None, expected: type
) -> None:
    """A waiter is at the head when it holds the gate of a semaphore, else in the queue."""
    found = role(AdvisoryRow.read(advisory(granted="f", query=query)), slot, None)
    assert type(found) is expected


def test_the_line_puts_the_head_first_and_each_session_once() -> None:
    """The window's sitter, then the gate's holder, then the queue, without repeats."""
    sitting = application_name("x", "waiting")
    rows = [
        advisory(granted="f", key="12", query=tag(slots=3, run="q1"), pid="1"),
        advisory(granted="f", key="11", query=tag(slots=3, run="h"), pid="2"),
        advisory(granted="f", key="12", query=tag(slots=3, run="h"), pid="3"),
        advisory(key="10", query=tag(run="s"), label=sitting, pid="4"),
        advisory(subid="2", objid="3"),
    ]
    line = Line.of((AdvisoryRow.read(row) for row in rows), {10: 0, 11: 1}, sitting)
    assert line.holders == []
    assert [holder.host for holder in line.waiters] == ["host-a"] * 3
    assert list(line.head) == ["s", "h"]
    assert list(line.queue) == ["q1", "h"]
    assert line.known == {1, 3}


_texts = st.none() | st.text(max_size=40)


@given(query=_texts, label=_texts, user=_texts, client=_texts, granted=st.sampled_from("tf"),
       slot=st.sampled_from([None, 0, 1]), sitting=_texts)  # fmt: skip
@example(query="/* lockrun {junk} */", label=None, user=None, client=None, granted="t", slot=0,
         sitting=None)  # fmt: skip
@example(query='/* lockrun {"token": "t", "slots": 1} */', label="", user="", client="",
         granted="f", slot=1, sitting="")  # fmt: skip
def test_status_rows_of_any_comment_take_one_role(
    query: str | None,
    label: str | None,
    user: str | None,
    client: str | None,
    granted: str,
    slot: int | None,
    sitting: str | None,
) -> None:
    """Whatever another role's statement and names say: one of the four roles, never an error."""
    raw = (
        "1",
        "11",
        "0",
        granted,
        "77",
        None,
        user,
        client,
        None,
        query,
        "ExclusiveLock",
        label,
        None,
    )
    found = role(AdvisoryRow.read(raw), slot, sitting)
    assert isinstance(found, Holding | Heading | Queued | Counted)


# -- --hold-at-least windows ---------------------------------------------------------------

# What the window's read (modes.WINDOW) may answer for rows a co-tenant wrote: the server cuts
# `until` to MAX_WAIT from now, so 'infinity' and the year 294276 come back as about a year.
FORGED_REMAINING = (
    ("31622399.999873", 31622399.999873),  # until 'infinity', cut by the server
    ("31622400", MAX_WAIT),
    ("3599.5", 3599.5),  # now() + 1 hour
    ("1e400", None),  # infinite once read: not from PostgreSQL, but decoded the same
    ("Infinity", None),
    ("-Infinity", None),
    ("NaN", None),
    ("-1", None),
    ("0", None),
    ("", None),
    (None, None),
    ("12abc", None),
)


@pytest.mark.parametrize(("text", "remaining"), FORGED_REMAINING)
def test_a_forged_window_is_at_most_366_days_or_none(
    text: str | None, remaining: float | None
) -> None:
    """A window read back is (0, MAX_WAIT] seconds, or no window at all."""
    expected = None if remaining is None else Window(remaining)
    assert parse_window([(text,)]) == expected


@given(rows=st.lists(st.tuples(_texts | st.floats().map(str), _texts), max_size=3))
@example(rows=[])
@example(rows=[()])
def test_window_answers_of_any_text_decode_within_bounds(
    rows: list[tuple[str | None, ...]],
) -> None:
    """What a window read returns, whatever a row held: no window, or one of 366 days at most."""
    window = parse_window(rows)
    assert window is None or 0 < window.remaining <= MAX_WAIT
    assert window is None or not math.isnan(window.remaining)


FORGED_HOLDER = (
    "",
    "not json",
    '{"token": 1, "namespace": [], "name": null}',
    json.dumps({"token": "t", "namespace": "default", "name": "another", "slots": 1,
                "holder": {"host": "h", "pid": 1, "user": "u"}}),
    "x" * 1_000_000,
    "x'); CREATE TABLE lockrun_injected (i int); --",
    "*/ CREATE TABLE lockrun_injected (i int); /*",
    "$$; CREATE TABLE lockrun_injected (i int); $$",
)  # fmt: skip


@pytest.mark.parametrize("record", FORGED_HOLDER, ids=range(len(FORGED_HOLDER)))
def test_a_forged_window_row_shows_as_held_by_the_table(record: str) -> None:
    """A row that is no record of this lock's: held by lockrun_holds, '?', pid 0, until kept."""
    [(who, until)] = open_windows([("-5", "2000000000.25", record)]).values()
    assert held_over((who, until), "default", "x", WINDOWS) == Holder(
        WINDOWS, 0, "?", (), slot=0, until=2000000000.25
    )


def test_a_window_row_of_this_lock_names_its_run() -> None:
    """A record of this very lock names its run, slot 0, exclusive, until its end."""
    record = json.loads(tag().removeprefix("/* lockrun ").removesuffix(" */ SELECT 1"))
    [window] = open_windows([("7", "1900000000", json.dumps(record))]).values()
    assert held_over(window, "default", "x", WINDOWS) == ME._replace(slot=0, until=1900000000.0)


@pytest.mark.parametrize("until", ["0", "-1", "1e13", "inf", "NaN", None, "soon"])
def test_window_ends_no_clock_could_show_are_skipped(until: str | None) -> None:
    """An end at or before 1970 or past 2^40 s, or no number: the row is no window."""
    assert open_windows([("7", until, "{}"), (None, "5", "{}"), ("k", "5", "{}")]) == {}


@given(
    rows=st.lists(
        st.tuples(_texts, _texts, _texts | st.builds(json.dumps, holder_like())), max_size=4
    )
)
def test_status_rows_of_any_text_decode_within_bounds(
    rows: list[tuple[str | None, str | None, str | None]],
) -> None:
    """Rows of lockrun_holds as status reads them: ends a clock could show, records or None."""
    for identity, until in open_windows(rows).values():
        assert 0 < until <= 2**40
        holder = held_over((identity, until), "default", "x", WINDOWS)
        assert holder.until == until
        assert holder.slot == 0


# -- a grant's rows, and takers ------------------------------------------------------------


def test_a_grant_row_says_whether_the_slot_is_ours_and_its_fence() -> None:
    """Got and the fence by name; a shared holder or a lost try has no fence."""
    assert Drawn.read([("t", "903", "x", "t")], shared=False) == Drawn(got=True, fence=903)
    assert Drawn.read([("t", None, "x")], shared=True) == Drawn(got=True, fence=None)
    assert Drawn.read([("t", None, "x")], shared=False) == Drawn(got=True, fence=None)  # no table
    assert Drawn.read([("f", None, None)], shared=False) == Drawn(got=False, fence=None)


def test_others_rows_split_users_of_another_n_from_takers() -> None:
    """Kind 2: (N, the holder's comment); kind 1: a stop key's holder."""
    found = Others.read(
        [
            ("2", "3", "50", tag(slots=3), "u", None, "f"),
            ("1", "0", "51", "SELECT 1", "eve", "10.1.1.1", "t"),
        ]
    )
    [user] = found.users
    assert user.slots == 3
    assert user.who is not None
    assert found.stops == [StopRow("51", "SELECT 1", "eve", "10.1.1.1", waiting=True)]


def test_a_check_says_whether_we_hold_the_slot_and_who_asks() -> None:
    """A row of ours (first column true) holds; the others are the stop key's holders."""
    assert Check.read([]) == Check(holds=False, stops=[])
    check = Check.read([("f", "60", None, "eve", None, "t"), ("t", "9", None, None, None, "f")])
    assert check.holds
    assert check.stops == [StopRow("60", None, "eve", None, waiting=True)]


def test_a_stop_key_is_ours_only_if_the_try_said_so() -> None:
    """The taker's try of the stop key and its NOTIFY: ('t', '') only."""
    assert stop_taken([("t", "")])
    assert not stop_taken([("f", "")])
    assert not stop_taken([])


def test_setup_row_is_read_by_name() -> None:
    """A new session's pid, whether the server is a standby, whether the tables exist."""
    assert Setup.read(("77", "f", "t", "f", "")) == Setup(
        pid=77, standby=False, windows=True, fences=False
    )


NAMES = ("default", "x")


@pytest.mark.parametrize(
    ("row", "heard", "named"),
    [
        (StopRow("5", None, "eve", None, waiting=True), set(), "eve@local socket (backend 5)"),
        (StopRow("5", None, None, "10.0.0.2", waiting=False), {5}, "?@10.0.0.2 (backend 5)"),
        (StopRow("5", None, "eve", None, waiting=False), set(), None),  # a leftover stop key
        (StopRow("5", tag(run="mine"), "eve", None, waiting=True), set(), None),  # our own
        (StopRow("5", tag(run="t2"), "eve", None, waiting=True), set(), "alice@host-a pid 101"),
        (
            StopRow("5", tag("y", run="t2"), "eve", None, waiting=True),
            set(),
            "eve@local socket (backend 5)",
        ),
        (StopRow("²", None, "eve", None, waiting=False), {2}, None),  # a digit int() refuses
    ],
)
def test_a_taker_is_named_by_its_comment_or_by_the_server(
    row: StopRow, heard: set[int], named: str | None
) -> None:
    """A stop key's holder that waits or rang: a lockrun of the name by its holder, else by role."""
    assert taker([row], "mine", NAMES, heard) == named


@given(
    rows=st.lists(
        st.tuples(_texts, _texts | st.builds(json.dumps, holder_like()), _texts, _texts, _texts),
        max_size=3,
    ),
    heard=st.sets(st.integers(0, 2**31)),
)
@example(rows=[("1", None, None, None, "t")], heard=set())
@example(rows=[("٣", None, None, None, None)], heard={3})
def test_stop_key_rows_of_any_shape_name_a_taker_or_none(
    rows: list[tuple[str | None, ...]], heard: set[int]
) -> None:
    """Whoever holds the stop key, however pg_stat_activity describes them: a name, or none."""
    found = taker([StopRow.read(row) for row in rows], "mine", NAMES, heard)
    assert found is None or isinstance(found, str)
