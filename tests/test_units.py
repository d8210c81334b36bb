"""Pure functions: durations, names, URIs, redaction, fences, what -v says while waiting."""

from __future__ import annotations

import json
import os
import re
import time
from typing import TYPE_CHECKING

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun import bounds, cli, progress
from lockrun import lock as lock_module
from lockrun.backends import (
    Holder,
    LockState,
    Request,
    next_fence,
    parse_uri,
    plain_json,
    write_json,
)
from lockrun.errors import ConfigError, LeaseLost, UsageError
from lockrun.names import check_name, default_name, escape, unescape
from lockrun.progress import holders_text, position_text
from lockrun.timing import clock_time, format_duration, now, parse_duration
from lockrun.uri import redact
from tests.support.cli import python

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("1.5", 1.5),
        (".5", 0.5),
        ("90s", 90),
        ("15m", 900),
        ("2h", 7200),
        ("1d", 86400),
        (" 3M ", 180),
        ("5\n", 5),  # $(cat file) in a variable
        ("0", 0),
        ("500ms", 0.5),
        ("1.5s", 1.5),
        ("1h30m", 5400),
        ("2d12h", 216000),
        ("1m30s", 90),
        ("1s500ms", 1.5),
        ("1h 30m", 5400),  # systemd.time(7) puts spaces between components
        ("1 h 30 m", 5400),
        ("1.5h", 5400),
        ("1d2h3m4s5ms", 93784.005),
        ("3m05s", 185),  # what format_duration prints
        ("2h00m", 7200),
        ("1d02h", 93600),
        ("0.25s", 0.25),
    ],
)
def test_durations_parse(text: str, seconds: float) -> None:
    """Every DURATION form of docs/semantics.md "Options" parses to seconds."""
    assert parse_duration(text) == pytest.approx(seconds)


def test_forever_only_where_allowed() -> None:
    """'forever' is None for --wait and an error elsewhere."""
    assert parse_duration("forever", allow_forever=True) is None
    with pytest.raises(UsageError, match="invalid duration 'forever'"):
        parse_duration("forever")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        (" \t ", "empty"),
        ("-1", "negative"),
        ("-1s", "negative"),
        ("+1s", "use seconds"),
        ("1.2.3", "use seconds"),
        ("1.5.5s", "use seconds"),
        ("5x", "use seconds"),
        ("1e3", "use seconds"),
        ("m", "use seconds"),
        ("ms", "use seconds"),
        ("s5", "use seconds"),
        ("1 5", "needs its unit"),
        ("1h30", "needs its unit"),
        ("nan", "use seconds"),
        ("1h1h", "largest first, each once"),
        ("30m1h", "largest first, each once"),
        ("1ms1s", "largest first, each once"),
        ("1s1s", "largest first, each once"),
        ("1m s", "use seconds"),
        ("5\x00", "use seconds"),
        ("١٢", "ASCII"),  # Arabic-Indic digits: str.isdigit() says yes, we say no
        ("１２ｓ", "ASCII"),  # fullwidth
        ("5\u2009s", "ASCII"),  # a thin space
        ("9" * 400, "too large"),
        ("9" * 400 + "d", "too large"),
    ],
)
def test_bad_durations_are_usage_errors(text: str, says: str) -> None:
    """Negative, malformed, non-ASCII and absurd durations raise UsageError (64), and say why."""
    with pytest.raises(UsageError) as raised:
        parse_duration(text, allow_forever=True)
    message = str(raised.value)
    assert says in message
    assert len(message) < 200, message  # 400 digits are not echoed back whole
    assert "\x00" not in message


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.25, "0.25s"), (2, "2s"), (12.4, "12s"), (185, "3m05s"), (7260, "2h01m")],
)
def test_durations_format_for_people(seconds: float, text: str) -> None:
    """Durations print short and exact enough."""
    assert format_duration(seconds) == text


def test_names_are_bounded_utf8() -> None:
    """Names are 1…255 bytes of UTF-8."""
    assert check_name("x" * 255) == "x" * 255
    for bad in ("", "x" * 256, "\udcff"):
        with pytest.raises(UsageError):
            check_name(bad)


def test_default_name_is_stable_and_argv_sensitive() -> None:
    """The derived name is basename plus a hash of the whole argv."""
    assert default_name(["/usr/bin/python3", "a.py"]) == default_name(["/usr/bin/python3", "a.py"])
    assert default_name(["/usr/bin/python3", "a.py"]).startswith("python3-")
    assert default_name(["python3", "a.py"]) != default_name(["python3", "b.py"])
    assert default_name(["/"]).startswith("command-")


@pytest.mark.parametrize("name", ["sales", "a.b/c d", "ünïcode", "%41", "~.~"])
def test_escape_round_trips_and_is_file_safe(name: str) -> None:
    """Escaped names contain no dot, slash or tilde and unescape to the original."""
    escaped = escape(name)
    assert not set(escaped) & set("./~ ")
    assert unescape(escaped) == name


def test_uris_parse_and_reject() -> None:
    """Known schemes parse; unknown and malformed ones are configuration errors."""
    assert parse_uri("file:").scheme == "file"
    assert parse_uri("file:///var/lock/x").path == "/var/lock/x"
    assert parse_uri("abstract:my%20app").path == "my app"
    for bad in ("redis2://x", "nonsense", ":x", "1file:"):
        with pytest.raises(ConfigError):
            parse_uri(bad)


@pytest.mark.parametrize(
    ("uri", "safe"),
    [
        ("redis://:hunter2@host/0", "redis://***@host/0"),
        ("mysql://ci:hunter2@db/ci", "mysql://***@db/ci"),
        ("postgresql://u:p%40ss@h/db?sslmode=require", "postgresql://***@h/db?sslmode=require"),
        (
            "postgresql:///db?user=u&password=hunter2&x=1",
            "postgresql:///db?user=u&password=***",  # to the end: an & may be the password's
        ),
        ("file:///tmp/x", "file:///tmp/x"),
        ("redis://user@host", "redis://***@host"),  # redis://SECRET@host: a password, often
        ("redis://:hunter@2secret@127.0.0.1:1/0", "redis://***@127.0.0.1:1/0"),
        ("redis://admin:AbC/dEf+Gh==@host/0", "redis://***@host/0"),
        (
            "redis+sentinel://:pw@a,b/svc?sentinel_password=sp",
            "redis+sentinel://***@a,b/svc?sentinel_password=***",
        ),
        ("redis+cluster://hunter2@a:7000,b:7001", "redis+cluster://***@a:7000,b:7001"),
        (
            "rediss+cluster://u:p@ss@a,b?ssl_cert_reqs=none",
            "rediss+cluster://***@a,b?ssl_cert_reqs=none",
        ),
        ("mysql://root@localhost/x?unix_socket=/tmp/a@b", "mysql://***@b"),  # too much: safe
        ("postgresql:///db?host=/run/pg@x", "postgresql:///db?host=/run/pg@x"),  # no authority
        ("redis://:pa?ss@host/0", "redis://***"),  # refused, so hiding too much is fine
        ("redis://:pa#ss@host/0", "redis://***"),
        ("redis:user:pass@host", "redis:***@host"),
        ("redis:///pass@host/0", "redis://***@host/0"),  # behind an empty authority
        ("unix:///run/a@b/redis.sock", "unix:///run/a@b/redis.sock"),  # a file name
        ("alice:secret@db/x", "***@db/x"),  # no scheme: all of it may be user information
        ("redis://h/0?a=b?password=x&y=1", "redis://h/0?a=b?password=***"),
    ],
)
def test_redaction_hides_passwords(uri: str, safe: str) -> None:
    """Passwords in the authority or the query never survive redaction."""
    assert redact(uri) == safe
    assert parse_uri("file:").redacted == "file:"


def test_fences_increase_and_survive_a_lost_counter() -> None:
    """A fence is above the previous one and above the microsecond clock."""
    clock = time.time_ns() // 1000
    assert next_fence(b"") >= clock
    assert next_fence(b"garbage") >= clock
    far = str(clock + 10**9).encode()
    assert next_fence(far) == clock + 10**9 + 1


def test_holder_records_round_trip() -> None:
    """Holder metadata survives JSON and rejects records that are not holders."""
    holder = Holder.me(["sleep", "1"])
    assert Holder.from_dict(holder.to_dict()) == holder
    with pytest.raises(ValueError, match="host"):
        Holder.from_dict({"pid": 1})


@given(
    st.from_regex(r"[0-9]{1,6}(\.[0-9]{0,3})?|\.[0-9]{1,3}", fullmatch=True),
    st.sampled_from(["", "ms", "d", "h", "m", "s"]),
)
def test_a_lone_number_and_unit_reads_as_the_spaced_form_does(number: str, unit: str) -> None:
    """`30s` (read without a regex, issue #32) is what `30 s` (read by the regex) is."""
    assert parse_duration(f"{number}{unit}") == parse_duration(f"{number} {unit}")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(JSON_VALUES)
def test_write_json_writes_what_json_dumps_writes(value: object) -> None:
    """A record written without json (issue #32) is json.dumps's, byte for byte.

    Both ways: by hand where json is not loaded (`plain_json`), and json's own once it is.
    """
    assert plain_json(value) == json.dumps(value)
    assert write_json(value) == json.dumps(value)


def test_import_lockrun_loads_no_click_and_no_driver() -> None:
    """`import lockrun` imports neither click nor a database driver (docs/api.md)."""
    drivers = "('click', 'redis', 'pymysql', 'psycopg')"
    probe = f"import sys, lockrun; print(sorted(m for m in {drivers} if m in sys.modules))"
    result = python(probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("option", ["pass%77ord", "sslpassword", "PASSWORD", "sentinel_password"])
def test_redact_hides_every_kind_of_password_option(option: str) -> None:
    """Any query option whose decoded name holds "pass" is hidden, with all that follows."""
    text = f"postgresql://h/db?host=/x&{option}=one&sslmode=require"
    assert redact(text) == f"postgresql://h/db?host=/x&{option}=***"


# -- what -v says while waiting ---------------------------------------------------------


def person(pid: int, since: float | None = None) -> Holder:
    """Return a holder or waiter *pid* on host vm."""
    return Holder("vm", pid, "alice", ("true",), since)


def test_holders_text_names_two_holders_then_counts_the_rest() -> None:
    """A semaphore's line names two holders and how many more there are."""
    noon = time.mktime((*time.localtime()[:3], 12, 3, 4, 0, 0, -1))  # today
    assert holders_text([]) == ""
    assert holders_text([person(1)]) == "vm:1"
    three = [person(1, noon), person(2, noon + 5), person(3)]
    assert holders_text(three) == "vm:1 since 12:03:04, vm:2 since 12:03:09 and 1 more"


@pytest.mark.parametrize(
    ("waiters", "queued", "said"),
    [
        ([], False, "next in line"),
        ([2, 3], False, "2 ahead of you"),  # before queueing, every waiter is ahead
        ([os.getpid(), 3], True, "next in line"),
        ([2, 3, os.getpid()], True, "2 ahead of you"),
        ([2, 3], True, ""),  # queued but not shown (yet): no guess
    ],
)
def test_position_text_counts_the_waiters_ahead(
    waiters: list[int], queued: bool, said: str
) -> None:
    """The place in the queue is the number of waiters ahead of this process."""
    me = Holder.me(["true"])
    line = [Holder(me.host, pid, "bob", ()) for pid in waiters]
    assert position_text(line, me, queued=queued) == said


def test_a_wait_report_that_cannot_read_status_keeps_its_last_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the second connection fails, the live line keeps the holder it knew and ticks."""
    monkeypatch.setattr(progress, "TICK", 0.01)
    monkeypatch.setattr(progress, "LIVE_STATUS", 0.02)
    not_a_directory = tmp_path / "file"
    not_a_directory.touch()
    uri = parse_uri(f"file://{not_a_directory}")
    request = Request("default", "sales", 1, 30.0, Holder.me(["true"]))
    drawn: list[str] = []
    report = progress.WaitReport(request, uri, log=drawn.append, live=drawn.append)
    report.start([LockState("default", "sales", "x", 1, (person(7),), ())])
    deadline = time.monotonic() + 10
    while len(drawn) < 20 and time.monotonic() < deadline:  # status was asked again and again
        time.sleep(0.01)
    report.stop()
    assert drawn[-1] == ""  # erased
    said = {frame.rpartition(" — ")[0] for frame in drawn[:-1]}  # less the seconds
    assert said == {"waiting for sales — held by vm:7 — next in line"}


@pytest.mark.parametrize("stamp", [1e300, float("nan"), -1e300])
def test_a_time_no_clock_can_show_is_a_question_mark(stamp: float) -> None:
    """A holder record with an impossible start time shows `?`, not a traceback."""
    assert clock_time(stamp) == "?"


class _RefusingLease:
    """A lease of 0.3 s whose every renewal the server refuses (ConfigError)."""

    ttl = 0.3
    slot, fence, fds, sessions, bells, orphan = 0, None, (), (), (), None

    def __init__(self) -> None:
        self.confirmed = now()

    def refresh(self) -> None:
        msg = "no such database on this server"
        raise ConfigError(msg)

    def release(self, hold: float = 0.0) -> bool:  # noqa: ARG002 - the protocol's
        return True


def test_the_api_renewer_takes_a_refused_renewal_for_a_doubt() -> None:
    """A refused renewal: the lease is lost once unconfirmed for a ttl; the thread lives.

    It died with a traceback on stderr, and leaving the block raised nothing.
    """
    held = lock_module.Lease(_RefusingLease(), ("file:", "default", "refused"))
    renewal = lock_module._Renewal(held)
    renewal.start()
    assert renewal.thread is not None
    renewal.thread.join(timeout=10)
    assert not renewal.thread.is_alive()
    assert isinstance(held.lost, LeaseLost)
    assert "no such database" in str(held.lost)
    with pytest.raises(LeaseLost, match="no such database"):
        held.check()


# -- which command a command line is for (#29 7b) ---------------------------------------------

_COMMANDS = (cli.run_command, *(command for command, _ in cli.SUBCOMMANDS.values()))
_SPELLINGS = sorted({spelling for command in _COMMANDS for spelling in cli.grammar(command)})


def test_every_spelling_takes_a_value_in_every_command_or_in_none() -> None:
    """`-w` takes a value wherever it is an option: the words after options read one way."""
    for spelling in _SPELLINGS:
        takes = {cli.grammar(command).get(spelling) for command in _COMMANDS} - {None}
        assert len(takes) == 1, spelling


@st.composite
def _option_words(draw: st.DrawFn) -> list[str]:
    """One option as a command line may spell it, with its value if it takes one."""
    spelling = draw(st.sampled_from(_SPELLINGS))
    takes = any(cli.grammar(command).get(spelling) for command in _COMMANDS)
    if not takes:
        return [spelling]
    value = draw(st.sampled_from([*cli.SUBCOMMANDS, "--", "-", "5", "x y", "-q"]))
    if spelling.startswith("--"):
        return draw(st.sampled_from([[f"{spelling}={value}"], [spelling, value]]))
    return draw(st.sampled_from([[f"{spelling}{value}"], [spelling, value]]))


@given(
    st.lists(_option_words(), max_size=4).map(lambda words: [w for each in words for w in each]),
    st.sampled_from(list(cli.SUBCOMMANDS)),
    st.lists(st.sampled_from([*cli.SUBCOMMANDS, "--", "-v", "NAME", "x"]), max_size=3),
)
def test_a_subcommand_word_after_options_is_never_a_program(
    options: list[str], subcommand: str, rest: list[str]
) -> None:
    """OPTIONS SUBCOMMAND …: the subcommand, OPTIONS moved behind it, or 64; after --, a program."""
    refused = None
    try:
        command, prog, args = cli.dispatch([*options, subcommand, *rest])
    except click.UsageError as err:
        refused = err.format_message()
    if refused is None:
        assert (command, prog) == (cli.SUBCOMMANDS[subcommand][0], f"lockrun {subcommand}")
        assert args == [*options, *rest]
    else:
        assert f"-- {subcommand} …" in refused
        taken = cli.grammar(cli.SUBCOMMANDS[subcommand][0])
        assert any(word.partition("=")[0] not in taken for word in options if word[:1] == "-")
    program = [*options, "--", subcommand, *rest]
    if "--" not in options:  # else the first `--` already ended the options
        assert cli.dispatch(program) == (cli.run_command, "lockrun", program)


# -- a bound's message shows the value, not the bound again (#29 8f) ------------------------

_BOUNDS = [  # (low, high, above) of each DURATION bound: lockrun.bounds and runner's checks
    (bounds.MIN_TTL, bounds.MAX_TTL, False),
    (0.0, bounds.MAX_WAIT, False),
    (0.0, bounds.MAX_WAIT, True),
    (0.0, bounds.MAX_KILL_AFTER, False),
]
_MESSAGE = re.compile(r"x must be (?:at least|more than) (\S+) and at most (\S+), not (\S+)")


@given(
    st.sampled_from(_BOUNDS),
    st.sampled_from([0, 1]),
    st.floats(min_value=-3600.0, max_value=3600.0),
    st.floats(min_value=0.0, max_value=1e12),
)
def test_a_value_out_of_bounds_never_reads_as_the_bound(
    limits: tuple[float, float, bool], near: int, offset: float, anywhere: float
) -> None:
    """A bound's message shows a value out of bounds in other words than the bound's."""
    low, high, above = limits
    seconds = max(0.0, limits[near] + offset) if offset else anywhere  # near a bound, mostly
    message = ""
    try:
        bounds.check_seconds(seconds, "x", low=low, high=high, above=above)
    except UsageError as err:
        message = str(err)
    if low < seconds <= high or (seconds == low and not above):
        assert message == ""
        return
    match = _MESSAGE.fullmatch(message)
    assert match is not None, message
    shown_low, shown_high, shown = match.groups()
    assert shown not in {shown_low, shown_high} or seconds in {low, high}
