"""Properties over random input: URIs and redaction, numbers, and records from anyone.

Pure code and the backends' parsers, no server: so many examples run in a second or two.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Final

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lockrun import ConfigError, Lock, UsageError
from lockrun.backends import Holder, next_fence, open_backend, parse_uri, read_identity, read_json
from lockrun.backends.file.records import read_record
from lockrun.backends.postgres import keys as postgres_keys
from lockrun.backends.redis import replies, topology
from lockrun.bounds import MAX_FENCE, MAX_SLOTS, check_seconds, check_slots, check_wait
from lockrun.timing import format_duration, parse_duration
from lockrun.uri import HIDDEN, URIError, redact, redacted_by_lockrun, scrub, secrets_of
from lockrun.uri import parse_uri as parse_uri_alone
from lockrun.urifile import read_uri_file
from tests.support.strategies import (
    TEMPLATES,
    assert_hidden,
    deep,
    holder_like,
    json_values,
    passwords,
    place,
    plain_passwords,
)

# -- URIs and redaction --------------------------------------------------------------------


@given(template=st.sampled_from(TEMPLATES), secret=passwords, encoded=st.booleans())
def test_no_fragment_of_a_password_survives_parsing_or_redaction(
    template: str, secret: str, encoded: bool
) -> None:
    """Raw or %-encoded, any password: redact() and every parser's message hide it all."""
    uri = place(template, secret, encoded=encoded)
    assert_hidden(secret, redact(uri))
    try:
        backend = open_backend(parse_uri(uri), ttl=5.0)
    except (ConfigError, UsageError) as err:  # refused: said without a piece of the password
        assert_hidden(secret, str(err))
    else:
        assert_hidden(secret, backend.settings.where)  # type: ignore[attr-defined]
        backend.close()


@given(template=st.sampled_from(TEMPLATES), secret=plain_passwords)
def test_a_percent_encoded_password_is_accepted_and_never_shown(template: str, secret: str) -> None:
    """Written as the README says (percent-encoded), any password parses and stays hidden."""
    uri = place(template, secret, encoded=True)
    backend = open_backend(parse_uri(uri), ttl=5.0)
    backend.close()
    assert_hidden(secret, redact(uri))
    assert not redacted_by_lockrun(uri)


@given(text=st.text(max_size=120))
def test_redact_and_parse_take_any_string(text: str) -> None:
    """Any text at all: redact() returns, parse_uri() returns or raises ConfigError.

    Beneath it, lockrun.uri's own parser refuses with URIError alone, in the same words.
    """
    assert isinstance(redact(text), str)
    try:
        alone = parse_uri_alone(text)
    except URIError as err:
        said = str(err)
    else:
        assert parse_uri(text) == alone
        return
    with pytest.raises(ConfigError) as raised:
        parse_uri(text)
    assert str(raised.value) == said


@given(template=st.sampled_from(TEMPLATES), secret=passwords)
# An empty authority, then a password holding # or ? before its @ (found by this property).
@example(template="redis://{secret}@127.0.0.1:{port}/0", secret="/JJJJ#")  # noqa: S106
@example(template="redis://{secret}@127.0.0.1:{port}/0", secret="/JJJJ?x")  # noqa: S106
def test_scrub_hides_whatever_a_driver_quotes_of_a_password(template: str, secret: str) -> None:
    """What a server or driver says, quoting the password or a piece of it, is scrubbed."""
    uri = place(template, secret, encoded=False)
    said = f'FATAL: password "{secret}" for user; near {secret[1:]!r} and {secret[:-1]}'
    assert_hidden(secret, scrub(said, secrets_of(uri)))


def test_a_redacted_uri_is_refused_by_a_nested_lockrun() -> None:
    """The *** lockrun leaves in a command's LOCKRUN_URI cannot pass for a password."""
    for uri in ("redis://:pw@h/0", "postgresql:///db?password=pw", "mysql://u@h/db"):
        shown = redact(uri)
        assert HIDDEN in shown
        assert redacted_by_lockrun(shown)
        with pytest.raises(ConfigError, match="replaced by \\*\\*\\* by the lockrun"):
            parse_uri(shown)


# Whatever a URI file holds: the URI as it should be, with spaces, lines, a NUL, a BOM, or a
# password alone; around it bytes of any kind.
_URI_FILE_SHAPES: Final = (
    "{uri}", "{uri}\n", " {uri} \r\n", "{uri}\n{uri}", "{uri}\0", "\ufeff{uri}", "{secret}\n", ""
)  # fmt: skip


@given(
    template=st.sampled_from(TEMPLATES),
    secret=passwords,
    shape=st.sampled_from(_URI_FILE_SHAPES),
    before=st.binary(max_size=8) | st.just(b""),
    after=st.binary(max_size=8) | st.just(b""),
    mode=st.sampled_from([0o600, 0o400, 0o640, 0o440, 0o644, 0o604, 0o620, 0o700]),
)
def test_a_uri_file_gives_its_uri_or_one_line_without_its_secret(
    tmp_path_factory: pytest.TempPathFactory,
    template: str,
    secret: str,
    shape: str,
    before: bytes,
    after: bytes,
    mode: int,
) -> None:
    """Any content and mode: the URI, or ConfigError naming the file and no piece of the secret."""
    path = tmp_path_factory.getbasetemp() / "uri-file"
    content = shape.format(uri=place(template, secret, encoded=False), secret=secret)
    path.write_bytes(before + content.encode() + after)
    path.chmod(mode)
    try:
        uri = read_uri_file(str(path), "--uri-file")
    except ConfigError as err:
        said = str(err)
    else:
        assert uri == uri.strip()
        assert "\n" not in uri
        assert not mode & (0o037 if os.geteuid() == 0 else 0o077)  # never read if open
        try:
            open_backend(parse_uri(uri), ttl=5.0).close()
        except (ConfigError, UsageError) as err:
            assert_hidden(secret, str(err))
        return
    assert said.startswith(f"--uri-file {path}: ")
    assert_hidden(secret, said)


# -- numbers --------------------------------------------------------------------------------


@given(text=st.text(max_size=40))
def test_durations_parse_or_are_usage_errors(text: str) -> None:
    """Any DURATION text: finite seconds >= 0, None for forever, or UsageError."""
    try:
        seconds = parse_duration(text, allow_forever=True)
    except UsageError:
        return
    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


# Text made of what DURATIONs are made of, so that most of it nearly parses.
duration_like = st.text(alphabet="0123456789.dhmsDHMS \t-+e", max_size=20) | st.builds(
    "".join, st.lists(st.sampled_from(["1", "05", ".5", "2.", "d", "h", "m", "s", "ms", " "]))
)


@given(text=duration_like)
def test_duration_shaped_text_parses_or_is_a_usage_error(text: str) -> None:
    """Text of digits and units: finite seconds >= 0, or UsageError naming the text."""
    try:
        seconds = parse_duration(text)
    except UsageError as err:
        said = str(err)
    else:
        assert seconds is not None
        assert math.isfinite(seconds)
        assert seconds >= 0
        return
    assert said.startswith("invalid duration ")


@given(seconds=st.floats(min_value=0, max_value=1e9, exclude_max=True))
def test_a_printed_duration_parses_back(seconds: float) -> None:
    """parse_duration(format_duration(x)) is x, to the precision format_duration prints."""
    back = parse_duration(format_duration(seconds))
    assert back is not None
    # format_duration keeps 2 decimals under 10 s, whole seconds under 1 h, then drops the
    # seconds (2h00m), then the minutes (1d02h).
    precision = (
        0.005 if seconds < 10 else 0.5 if seconds < 3599.5 else 60 if seconds < 86400 else 3600
    )
    assert abs(back - seconds) <= precision


anything = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=5)
    | st.lists(st.integers(), max_size=2)
)


@given(value=anything)
def test_every_bound_takes_anything_and_answers_usage_error(value: object) -> None:
    """slots, waits and durations: in bounds, or UsageError; never a raw Python error."""
    for check in (check_slots, check_wait):
        try:
            checked = check(value)
        except UsageError:
            continue
        assert checked is None or not isinstance(checked, bool)
    try:
        seconds = check_seconds(value, "--x", high=10.0)
    except UsageError:
        return
    assert 0 <= seconds <= 10


@given(
    slots=anything,
    wait=anything,
    ttl=anything,
    name=anything,
    modes=st.fixed_dictionaries(
        {}, optional=dict.fromkeys(("shared", "hold_at_least", "take_over"), anything)
    ),
)
def test_the_api_says_usage_error_for_any_bad_argument(
    slots: object, wait: object, ttl: object, name: object, modes: dict[str, object]
) -> None:
    """Lock(...) with wrong types, NaN, infinity, 2.5 slots, odd modes: UsageError only."""
    try:
        Lock(name, uri="file:///nonexistent/x", slots=slots, wait=wait, ttl=ttl, **modes)  # type: ignore[arg-type]
    except (UsageError, ConfigError):
        return


def test_the_api_reads_infinity_as_forever() -> None:
    """wait=math.inf waits for ever, as wait=None does."""
    assert Lock("x", uri="file:///nonexistent/x", wait=math.inf).wait is None
    for bad in (math.nan, -1, "10", 2.5j, True):
        with pytest.raises(UsageError):
            Lock("x", uri="file:///nonexistent/x", wait=bad)  # type: ignore[arg-type]
    for bad in (0, 2.5, True, MAX_SLOTS + 1, "3"):
        with pytest.raises(UsageError):
            Lock("x", uri="file:///nonexistent/x", slots=bad)  # type: ignore[arg-type]


# -- records from anyone --------------------------------------------------------------------


@given(data=holder_like() | json_values)
def test_holder_records_decode_or_are_refused(data: object) -> None:
    """Any JSON as a holder: a Holder within bounds, or ValueError; nothing else."""
    try:
        holder = Holder.from_dict(data)
    except ValueError:
        return
    assert isinstance(holder.pid, int)
    assert 0 <= holder.pid < 2**31
    assert holder.slot is None or 0 <= holder.slot < MAX_SLOTS
    for stamp in (holder.since, holder.expires, holder.until):
        assert stamp is None or 0 <= stamp <= 2**40
    assert holder.shared is (isinstance(data, dict) and data.get("shared") is True)
    assert len(holder.host) <= 256
    assert all(isinstance(arg, str) for arg in holder.argv)


@given(data=holder_like() | json_values)
def test_identities_decode_or_are_none(data: object) -> None:
    """A SQL comment's identity from anyone: well formed and bounded, or None."""
    text = json.dumps(data)
    identity = read_identity(text)
    if identity is not None:
        assert 1 <= identity.slots <= MAX_SLOTS
        assert 0 < len(identity.name.encode()) <= 255


def test_an_identity_with_no_slots_is_none() -> None:
    """A comment saying slots 0 (or a bool) names no N a lockrun uses: not believed."""
    for slots in (0, False, -1, MAX_SLOTS + 1):
        text = json.dumps({"token": "t", "namespace": "n", "name": "x", "slots": slots})
        assert (
            read_identity(text[:-1] + ', "holder": {"host": "h", "pid": 1, "user": "u"}}') is None
        )


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deeply_nested_records_are_no_records(depth: int) -> None:
    """JSON nested past the decoder's stack is unreadable, not a RecursionError."""
    assert read_json(deep(3)) == [[[]]]
    assert read_json(deep(depth)) is None
    assert read_identity(deep(depth)) is None
    assert read_record(deep(depth).encode(), "x") is None


@given(content=st.binary(max_size=300) | st.builds(lambda d: json.dumps(d).encode(), holder_like()))
def test_lock_file_records_decode_or_are_ignored(content: bytes) -> None:
    """Whatever a co-user writes into a lock file: a record of this lock, or None."""
    record = read_record(content, "sales")
    if record is not None:
        assert record.name == "sales"
        assert 1 <= record.slots <= MAX_SLOTS


@given(
    previous=st.binary(max_size=40)
    | st.integers(min_value=-(2**70), max_value=2**80).map(lambda n: str(n).encode())
)
def test_fences_stay_64_bit_and_above_the_clock(previous: bytes) -> None:
    """A fence counter anyone wrote: the next fence is above it or the clock, below 2^63."""
    before = time.time_ns() // 1000
    fence = next_fence(previous)
    assert before <= fence <= MAX_FENCE
    text = previous.strip()
    if text.isdigit() and int(text) < MAX_FENCE - 1:
        assert fence >= int(text) + 1


@given(query=st.text(max_size=200))
def test_sql_comments_from_anyone_decode_or_are_ignored(query: str) -> None:
    """pg_stat_activity's query text of any session: an identity or None."""
    identity = postgres_keys.tagged(query)
    assert identity is None or 1 <= identity.slots <= MAX_SLOTS


@given(
    owner=st.text(max_size=80) | st.from_regex(r"\A[0-9]{1,25} [0-9 ]{1,25}\Z"),
    slots=st.text(max_size=30) | st.integers(-5, 10**6).map(str),
)
def test_redis_counters_from_anyone_decode_or_are_ignored(owner: str, slots: str) -> None:
    """The owners hash and the stored N of a Redis lock: read only when they are ours."""
    n = replies.stored_slots(slots)
    assert n is None or 1 <= n <= MAX_SLOTS
    match = replies.OWNER.fullmatch(owner)
    if match is not None:
        assert all(int(match[part]) < 10**19 for part in ("slot", "fence", "granted"))


_sentinel_scalars = (
    st.none() | st.booleans() | st.integers() | st.text(max_size=12) | st.binary(max_size=12)
)
_sentinel_fields = st.sampled_from(["flags", "master-link-status", b"flags", "ip", "port"])
_sentinel_flags = st.lists(
    st.sampled_from(
        ["master", "slave", "s_down", "o_down", "disconnected", "failover_in_progress"]
    ),
    max_size=4,
).map(",".join)
_sentinel_maps = st.dictionaries(_sentinel_fields, _sentinel_scalars | _sentinel_flags, max_size=4)
_sentinel_replies = st.recursive(
    _sentinel_scalars | _sentinel_maps,
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner),
    max_leaves=12,
)


@given(address=_sentinel_replies, master=_sentinel_replies, replicas=_sentinel_replies)
def test_sentinel_replies_of_any_shape_decode_or_are_ignored(
    address: object, master: object, replicas: object
) -> None:
    """A sentinel (or a server posing as one) may answer anything: a view, or no vote."""
    view = topology.SentinelView.read(address, master, replicas)
    if view is not None:
        host, port = view.primary
        assert isinstance(host, str)
        assert port >= 0
        assert view.replicas >= 0


@pytest.mark.parametrize("resp3", [False, True])
def test_sentinel_views_count_replicas_that_are_up_and_see_failovers(resp3: bool) -> None:
    """RESP2's flat lists and RESP3's maps read alike; a down replica cannot be promoted."""

    def reply(**fields: str) -> object:
        pairs = {key.replace("_", "-").encode(): value.encode() for key, value in fields.items()}
        return pairs if resp3 else [part for pair in pairs.items() for part in pair]

    replicas = [
        reply(flags="slave", master_link_status="err"),  # up, not in sync: promotable
        reply(flags="slave,s_down,disconnected", master_link_status="err"),
        reply(flags="slave,o_down", master_link_status="ok"),
    ]
    master = reply(flags="master,failover_in_progress", num_slaves="3")
    view = topology.SentinelView.read([b"10.0.0.1", b"6380"], master, replicas)
    assert view == topology.SentinelView(("10.0.0.1", 6380), 1, failing_over=True)
    for port in (b"port", "²".encode(), b"-1", b""):  # "²".isdigit(), but no int
        assert topology.SentinelView.read((b"h", port), master, replicas) is None
    calm = topology.SentinelView.read(["h", "1"], reply(flags="master"), [])
    assert calm == topology.SentinelView(("h", 1), 0, failing_over=False)


# Any character but NUL, SQL's quoting and comment characters often.
sql_ish = st.sampled_from("'\"\\/*$;-#`E ")
names = st.text(
    sql_ish | st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]), min_size=1
).filter(lambda name: len(name.encode()) <= 255)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=names)
@example(name="x'; SELECT pg_terminate_backend(pg_backend_pid()); --")
@example(name="\\'")
@example(name="$$ /* '")
def test_any_name_goes_into_postgresql_statements_as_data(postgres_uri: str, name: str) -> None:
    """Any lock name, quotes, backslashes, comment openers and all, is a literal on the server.

    The grant writes it into its statement text as application_name (libpq's escaping).
    The server's pg_locks shows the slot granted to the session that carries it; where the
    name is printable ASCII (the server makes a ? of anything else), exactly that name.
    """
    import psycopg

    cut = postgres_keys.application_name(name, 0)
    with Lock(name, uri=postgres_uri, namespace="props") as lease:
        assert lease.fence
        with psycopg.connect(postgres_uri, autocommit=True) as server:
            [(shown,)] = server.execute(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
                "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
                "AND l.objsubid = 1 AND (l.classid::bigint << 32 | l.objid::bigint) = %s",
                (postgres_keys.lock_key("props", name, 0),),
            ).fetchall()
    if cut.isascii() and cut.isprintable():
        assert shown == cut
