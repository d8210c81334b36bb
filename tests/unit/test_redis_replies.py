"""Redis, in-process: the scripts' texts, their replies decoded, URIs, topology checks."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun.backends import Holder, Request, parse_uri, taken_over_by
from lockrun.backends.redis import DETACHED, SHARED, Claim, key_prefix, parse, topology, wire
from lockrun.backends.redis import replies as r
from lockrun.backends.redis.cluster import NotDurable, nodes_in, primaries_in, slot_of
from lockrun.backends.redis.scripts import (
    ACQUIRE,
    DROP,
    RELEASE,
    RENEW,
    SCRIPTS,
    SHA1,
    STATUS,
    info_pattern,
    keys_of,
)
from lockrun.backends.redis.server import Server
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.errors import BackendUnavailable, ConfigError, LockrunError

if TYPE_CHECKING:
    from lockrun.backends.redis.uri import Settings

# Any reply RESP3 can bring up from Lua, nested: what a forged server may answer.
_LEAVES = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=4)
ANY_REPLY = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=9), max_leaves=30)
DECODERS = [ACQUIRE.decode, RENEW.decode, RELEASE.decode, DROP.decode, STATUS.decode]


def record(user: str = "ann") -> str:
    """Return a holder record as the acquire script stores it."""
    return json.dumps(Holder("box", 42, user, ("sleep", "1")).to_dict())


# -- the scripts ---------------------------------------------------------------------------------


def test_every_script_starts_with_the_prelude_and_its_limits() -> None:
    """The server sees MAX_SLOTS and MAX_WINDOW, then the prelude, then the script's own file."""
    for script in SCRIPTS.values():
        first, second = script.text.splitlines()[:2]
        assert first == f"local MAX_SLOTS = {MAX_SLOTS}"
        assert second.startswith(f"local MAX_WINDOW = {round(MAX_WAIT * 1000)}")
        assert "unpack(KEYS)" in script.text
        assert "-- #include machinery.lua\n" not in script.text


def test_the_general_path_comes_after_each_fast_path() -> None:
    """A free lock taken, or the lone holder leaving, returns before the machinery is defined."""
    for script, fast in ((ACQUIRE, "EXISTS', holders, queue"), (RELEASE, "first_two")):
        assert script.text.index(fast) < script.text.index("local function configured_n")
    assert "configured_n" not in STATUS.text
    assert "configured_n" in RENEW.text
    assert "configured_n" in DROP.text


def test_each_script_is_named_by_the_sha1_of_its_text() -> None:
    """EVALSHA's names: five distinct digests of 40 hex digits."""
    assert set(SHA1) == {"acquire", "renew", "release", "drop", "status"}
    assert all(re.fullmatch(r"[0-9a-f]{40}", sha) for sha in SHA1.values())
    assert len(set(SHA1.values())) == len(SHA1)
    assert repr(ACQUIRE) == "Script('acquire')"


def test_the_keys_follow_the_preludes_order_under_one_hash_tag() -> None:
    """KEYS are holders … stop, in the order the prelude unpacks them, all in one slot."""
    prefix = key_prefix("ns", "a{b}/c d*")
    assert prefix == "lockrun:{ns/a%7Bb%7D%2Fc%20d%2A}"
    names = [key.rpartition(":")[2] for key in keys_of(prefix)]
    assert names == [
        *("holders", "queue", "waiters", "ticket", "fence"),
        *("owners", "info", "n", "clients", "stop"),
    ]
    assert {slot_of(key) for key in keys_of(prefix)} == {slot_of(prefix)}
    assert info_pattern("n s") == "lockrun:{n%20s/*}:info"


def test_a_claim_says_shared_and_detached_in_its_token() -> None:
    """A reader's token starts "s:", a detached lease's "d:ID"; the ttl in whole ms, at least 1."""
    holder = Holder.me(["x"])
    plain = Claim.of(Request("ns", "job", 2, 0.0001, holder))
    assert re.fullmatch(r"[0-9a-f]{20}", plain.token)
    assert (plain.prefix, plain.slots, plain.ttl_ms) == (key_prefix("ns", "job"), 2, 1)
    shared = Claim.of(Request("ns", "job", 1, 30, holder, shared=True, lease_id="abc"))
    assert shared.token == f"{SHARED}{DETACHED}abc"
    assert shared.ttl_ms == 30_000
    assert Claim.reading("p") == Claim("p", "", 1, 1)


# -- the acquire reply ---------------------------------------------------------------------------


def test_a_grant_decodes_to_its_slot_and_fence() -> None:
    """{1, slot, fence, 0, ''}: Granted; the woken after it are not ours to pass over."""
    assert r.decode_acquire([1, 3, 17, 0, "", "t", "9"]) == r.Granted(3, 17)


def test_another_n_decodes_to_a_mismatch() -> None:
    """{-1, N in use, 0, 0, ''}: Mismatch."""
    assert r.decode_acquire([-1, 5, 0, 0, ""]) == r.Mismatch(5)


def test_a_slot_given_back_names_the_taker() -> None:
    """{2, 0, 0, 0, record, woken…}: GaveWay, with the record and the pairs it woke."""
    assert r.decode_acquire([2, 0, 0, 0, record(), "t1", "7", "t2", ""]) == r.GaveWay(
        record(), (("t1", "7"), ("t2", ""))
    )


def test_a_place_in_the_queue_decodes_with_its_waits() -> None:
    """{0, rank, ms to a lapse, ms of a window, ''}: Queued; any other code queues too."""
    assert r.decode_acquire([0, 2, 150, 900, ""]) == r.Queued(2, 150, 900, ())
    assert r.decode_acquire([7, 0, 0, 0, "", "a", "b"]) == r.Queued(0, 0, 0, (("a", "b"),))


@pytest.mark.parametrize(
    "reply",
    [
        None,
        1,
        "OK",
        [],
        [1, 0, 0, 0],  # no text
        [1, 0, 0, "0", ""],  # a number as text
        [1, 0, 0, 0, 5],  # no text where the record goes
        [1, 0, 0, 0, "", "t"],  # half a pair
        [0, 0, 0, 0, "", "t", 5],  # a CLIENT ID that is no text
        [0, 0, [0], 0, ""],
        (1, 0, 0, 0, ""),  # not a list
    ],
)
def test_a_forged_acquire_reply_is_malformed(reply: Any) -> None:
    """Whatever our script could not have said raises Malformed, never a grant."""
    with pytest.raises(r.Malformed):
        r.decode_acquire(reply)


# -- renew, release, drop --------------------------------------------------------------------------


def test_a_renewal_is_extended_lost_or_asked_to_stop() -> None:
    """1: extended; 0 (or any other number): lost; a text: extended, with the taker's record."""
    assert r.decode_renew(1) == r.Renewed(None)
    assert r.decode_renew(True) == r.Renewed(None)  # noqa: FBT003 - Lua's true is RESP's 1
    assert r.decode_renew(0) is None
    assert r.decode_renew(-3) is None
    assert r.decode_renew(record()) == r.Renewed(record())
    for forged in (None, [], [1], b"1", 1.0):
        with pytest.raises(r.Malformed):
            r.decode_renew(forged)


def test_the_woken_decode_to_pairs() -> None:
    """{token, CLIENT ID, …} pairs; an odd count, or a number among them, is malformed."""
    assert r.decode_woken([]) == ()
    assert r.decode_woken(["a", "1", "b", ""]) == (("a", "1"), ("b", ""))
    for forged in (["a"], ["a", 1], "a", None, [["a", "b"]]):
        with pytest.raises(r.Malformed):
            r.decode_woken(forged)


def test_who_to_ask_after_and_who_is_gone() -> None:
    """CLIENT IDs to look up, once per token; the dead are those named but not listed."""
    woken = (("a", "1"), ("b", ""), ("c", "3"), ("a", "4"))
    assert r.clients_of(woken) == ["4", "3"]
    assert r.gone(woken, {"3"}) == ["a", "4"]
    assert r.gone(woken, {"3", "4"}) == []
    assert r.clients_of(()) == []


def test_granted_is_asked_of_the_raw_reply() -> None:
    """Before decoding (whether a replica must have it): a grant, an extension, or a taker's."""
    assert r.granted([1, 0, 5, 0, ""])
    assert r.granted(1)
    assert r.granted("record")
    assert not r.granted([0, 1, 5, 0, ""])
    assert not r.granted(0)
    assert not r.granted(None)


# -- status ----------------------------------------------------------------------------------------


def snapshot_reply(now_ms: int = 1_000_000, **parts: Any) -> list[Any]:
    """Return a status reply: *parts* in place of the empty lists."""
    empty: dict[str, Any] = {"holders": [], "queue": [], "owners": [], "info": [], "waiters": []}
    empty |= parts
    fields = ("holders", "queue", "owners", "info", "waiters")
    return [now_ms, parts.get("n", "1"), *(empty[field] for field in fields)]


def test_a_status_reply_decodes_to_a_snapshot() -> None:
    """Seven fields: the server's ms, the stored N as text, and the five lists."""
    reply = snapshot_reply(holders=["t", "2000000"], queue=["w"], waiters=["w", "1500000"])
    assert r.decode_status(reply) == r.Snapshot(
        1_000_000, "1", {"t": "2000000"}, ["w"], {}, {}, {"w": "1500000"}
    )


@pytest.mark.parametrize(
    "reply",
    [
        snapshot_reply()[:6],
        [*snapshot_reply(), []],
        ["1000", *snapshot_reply()[1:]],
        [1000, 1, *snapshot_reply()[2:]],
        snapshot_reply(holders=["t"]),
        snapshot_reply(queue=[1]),
        snapshot_reply(owners="t 0 0 0"),
        snapshot_reply(holders=["t", "soon"]),
        snapshot_reply(waiters=["t", ""]),
    ],
)
def test_a_forged_status_reply_is_malformed(reply: Any) -> None:
    """Short, long, mistyped, odd pairs, or a score no sorted set holds: Malformed."""
    with pytest.raises(r.Malformed):
        r.decode_status(reply)


def test_a_snapshot_describes_holders_windows_and_waiters() -> None:
    """Live holders with slot, grant and window; waiters in queue order; the lapsed left out."""
    now_ms = 1_000_000
    reply = snapshot_reply(
        now_ms,
        n="2",
        holders=["a", "1030000", f"{SHARED}b", "1030000", f"{DETACHED}c", "1040000", "old", "5"],
        owners=["a", "1 7 990000 1030000", f"{DETACHED}c", "0 8 995000"],
        info=["a", record("ann"), f"{DETACHED}c", record("cy"), f"{SHARED}b", "not json"],
        queue=["w", "gone", "lapsed"],
        waiters=["w", "1010000", "lapsed", "10"],
    )
    state = r.describe(r.decode_status(reply), "ns", "job", "lockrun:{ns/job}")
    assert state is not None
    assert state.slots == 2
    by_user = {holder.user: holder for holder in state.holders}
    assert set(by_user) == {"ann", "?", "cy"}
    window = by_user["ann"]
    assert (window.slot, window.since, window.expires, window.until) == (1, 990.0, 1030.0, 1030.0)
    assert not window.detached
    assert by_user["?"].shared
    assert by_user["?"].slot is None  # no owners entry: shown as a holder, nothing more
    assert by_user["cy"].detached
    assert by_user["cy"].until is None
    assert [waiter.user for waiter in state.waiters] == ["?"]


def test_a_free_lock_is_reported_only_when_named() -> None:
    """Nobody holds or waits: None in a namespace listing, a free state when asked by name."""
    snapshot = r.decode_status(snapshot_reply(n=""))
    assert r.describe(snapshot, "ns", None, "lockrun:{ns/a%20b}") is None
    state = r.describe(snapshot, "ns", "a b", "lockrun:{ns/a%20b}")
    assert state is not None
    assert (state.name, state.slots, state.holders, state.waiters) == ("a b", None, (), ())
    listed = r.describe(
        r.decode_status(snapshot_reply(holders=["t", "inf"])), "ns", None, "lockrun:{ns/a%20b}"
    )
    assert listed is not None
    assert listed.name == "a b"


def test_a_window_from_anyone_is_shown_no_later_than_the_longest() -> None:
    """An expiry of +inf (another client's) ends the window at most MAX_WAIT from now."""
    reply = snapshot_reply(1000, holders=["t", "inf"], owners=["t", "0 1 500 99"])
    state = r.describe(r.decode_status(reply), "ns", "x", "p")
    assert state is not None
    assert state.holders[0].until == 1 + MAX_WAIT


def test_the_window_left_counts_from_the_grant() -> None:
    """From owners' grant time; an entry none of ours leaves the whole window from now."""
    snapshot = r.decode_status(snapshot_reply(10_000, owners=["t", "0 1 9000"]))
    assert r.window_left(snapshot, "t", 5000) == 4000
    assert r.window_left(snapshot, "t", 500) == 0
    assert r.window_left(snapshot, "other", 5000) == 5000


@given(text=st.text(max_size=30) | st.integers(-5, 10**6).map(str))
def test_a_stored_n_is_believed_only_in_range(text: str) -> None:
    """The stored N: a number of 1 … MAX_SLOTS written plainly, else None."""
    n = r.stored_slots(text)
    assert n is None or (1 <= n <= MAX_SLOTS and str(n) == text)


def test_a_takers_record_names_it_or_says_unreadable() -> None:
    """The reason given to a holder that is taken over."""
    assert taken_over_by(record("bo")) == "taken over by bo@box pid 42"
    assert taken_over_by("{") == "taken over by another lockrun, whose record is unreadable"


# -- any reply at all ------------------------------------------------------------------------------


@given(reply=ANY_REPLY)
def test_any_reply_decodes_or_is_malformed(reply: Any) -> None:
    """Every decoder returns its type or raises Malformed, whatever the shape."""
    for decode in DECODERS:
        try:
            decoded = decode(reply)
        except r.Malformed:
            continue
        assert decoded is None or isinstance(decoded, tuple)


@given(
    reply=st.tuples(
        st.integers(-3, 3),
        st.integers(),
        st.integers(),
        st.integers(),
        st.text(max_size=5),
        st.lists(st.text(max_size=3), max_size=6),
    )
)
def test_any_well_shaped_acquire_reply_decodes(reply: tuple[Any, ...]) -> None:
    """Four numbers, a text and an even number of texts: always one of the four outcomes."""
    *head, woken = reply
    if len(woken) % 2:
        woken = woken[:-1]
    decoded = r.decode_acquire([*head, *woken])
    assert isinstance(decoded, r.Granted | r.Mismatch | r.GaveWay | r.Queued)


@given(
    holders=st.lists(st.text(max_size=4), max_size=6),
    owners=st.lists(
        st.text(max_size=12) | st.from_regex(r"\A\d{1,20} \d{1,3} \d{1,8}( \d{1,8})?\Z"), max_size=6
    ),
    info=st.lists(st.text(max_size=20), max_size=6),
    scores=st.lists(st.floats(allow_nan=False).map(repr) | st.just("inf"), max_size=6),
)
def test_any_snapshot_of_anyones_keys_describes(
    holders: list[str], owners: list[str], info: list[str], scores: list[str]
) -> None:
    """Whatever another client wrote in the owners and info hashes: a state, never a crash."""
    zipped = [item for pair in zip(holders, scores, strict=False) for item in pair]
    hashed = [item for pair in zip(holders, owners, strict=False) for item in pair]
    infos = [item for pair in zip(holders, info, strict=False) for item in pair]
    reply = snapshot_reply(holders=zipped, owners=hashed, info=infos, queue=holders)
    state = r.describe(r.decode_status(reply), "ns", "n", "p")
    assert state is not None
    assert all(h.slot is None or 0 <= h.slot < MAX_SLOTS for h in state.holders)


@given(reply=ANY_REPLY)
def test_the_backend_answers_any_reply_with_its_type_or_one_line(reply: Any) -> None:
    """Through `Server.call`: each script's type, or BackendUnavailable naming the script (69)."""
    server = Server(settings_of("redis://h"), 5.0, lambda _line: None)
    server.mode_known = True  # as if HELLO had said: no cluster
    server._on_a_pooled_connection = lambda *_args, **_kwargs: reply  # type: ignore[method-assign]
    for script in SCRIPTS.values():
        said: list[str] = []
        try:
            decoded = server.call(script, Claim.reading("p"))
        except BackendUnavailable as err:
            said.append(str(err))
        else:
            assert decoded is None or isinstance(decoded, tuple)
        assert said in ([], [f"redis://h: the server's reply is not Redis's (to {script.name})"])


def test_the_backend_says_not_redis_in_one_line() -> None:
    """A malformed reply becomes the backend's one line, 69, naming the script."""
    err = wire.not_redis("redis://h:6379/0", "acquire")
    assert isinstance(err, BackendUnavailable)
    assert str(err) == "redis://h:6379/0: the server's reply is not Redis's (to acquire)"


# -- URIs ------------------------------------------------------------------------------------------


def settings_of(text: str) -> Settings:
    """Return the settings of lock URI *text*."""
    return parse(parse_uri(text))


def test_each_scheme_parses_into_its_settings() -> None:
    """Plain, TLS, unix, Sentinel and Cluster URIs: host, database, TLS, sentinels, nodes."""
    plain = settings_of("redis://u:pw@h:7000/3")
    assert {key: plain.kwargs[key] for key in ("host", "port", "db", "username")} == {
        "host": "h",
        "port": 7000,
        "db": 3,
        "username": "u",
    }
    assert "pw" not in plain.where
    assert settings_of("rediss://h?ssl_cert_reqs=none").kwargs["ssl_cert_reqs"] == "none"
    unix = settings_of("unix:///run/redis.sock?db=2&password=x")
    assert (unix.kwargs["unix_socket_path"], unix.kwargs["db"], unix.kwargs["password"]) == (
        "/run/redis.sock",
        2,
        "x",
    )
    sentinel = settings_of("redis+sentinel://a,b:5000/svc/1?sentinel_password=s")
    assert sentinel.sentinels == (("a", 26379), ("b", 5000))
    assert (sentinel.service, sentinel.kwargs["db"]) == ("svc", 1)
    assert sentinel.sentinel_kwargs == {"username": None, "password": "s"}
    cluster = settings_of("rediss+cluster://a,b:7001/0")
    assert cluster.cluster == (("a", 6379), ("b", 7001))
    assert cluster.kwargs["ssl"] is True


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("redis://h/0?db=1", "given twice"),
        ("redis://h/x", "is not a number"),
        ("redis://h?timeout=1", "unknown option 'timeout' (allowed: db)"),
        ("redis+cluster://h?db=0", "unknown option 'db' (allowed: none)"),
        ("unix://", "expected unix:///path"),
        ("redis+sentinel://h", "expected redis+sentinel://"),
        ("redis+cluster://h/2", "database 0 alone"),
        ("rediss://h?ssl_cert_reqs=maybe", "none, optional or required"),
        ("rediss://h?ssl_ca_certs=/nonexistent/ca.pem", "no such readable file"),
        ("redis://[::1", "redis://"),
    ],
)
def test_a_bad_uri_is_one_config_error(text: str, words: str) -> None:
    """Each mistake of a Redis URI: ConfigError (78), saying what is wrong."""
    with pytest.raises(ConfigError, match=re.escape(words)):
        settings_of(text)


# -- topology --------------------------------------------------------------------------------------


def view(port: int, replicas: int = 0, *, failing: bool = False) -> topology.SentinelView:
    """Return a sentinel's view of a primary at h:*port*."""
    return topology.SentinelView(("h", port), replicas, failing)


def test_the_primary_most_sentinels_name_wins() -> None:
    """A majority of all sentinels (not of those that answered) must agree."""
    assert topology.majority([view(1, 1), view(1, 2), view(2)], 3) == view(1, 2)
    assert topology.majority([view(1, failing=False), view(1), view(2, failing=True)], 3) == view(
        1, failing=True
    )
    assert topology.majority([view(1), view(2)], 3) is None
    assert topology.majority([view(1), view(1)], 4) is None
    assert topology.majority([], 1) is None


class Connection:
    """A connection that answers WAIT with *acknowledged*, and records what it was sent."""

    def __init__(self, acknowledged: int = 1, hello: Any = None) -> None:
        """Answer WAIT with *acknowledged*; *hello*: the server's answer to HELLO."""
        self.acknowledged = acknowledged
        self.sent: list[tuple[Any, ...]] = []
        self.handshake_metadata = hello

    def send_command(self, *words: Any) -> None:
        """Record *words*."""
        self.sent.append(words)

    def read_response(self) -> int:
        """Answer WAIT."""
        return self.acknowledged

    def connect(self) -> None:
        """Connect: a no-op, as on a connected connection."""


def test_a_primary_is_trusted_only_where_a_failover_keeps_the_write() -> None:
    """Not a primary, a failover under way, no replica acknowledging, or unsynced replicas up."""
    master = ["master", 0, [["r", "1", "0"]]]
    lone = ["master", 0, []]
    with pytest.raises(NotDurable, match="is not a primary"):
        topology.check_primary(
            Connection(), view(1), ["slave"], written=False, service="s", wait_ms=5
        )
    with pytest.raises(NotDurable, match="failover of 's'"):
        topology.check_primary(
            Connection(), view(1, failing=True), master, written=True, service="s", wait_ms=5
        )
    connection = Connection(acknowledged=0)
    with pytest.raises(NotDurable, match="within 5ms"):
        topology.check_primary(connection, view(1), master, written=True, service="s", wait_ms=5)
    assert connection.sent == [("WAIT", 1, 5)]
    topology.check_primary(Connection(), view(1), master, written=True, service="s", wait_ms=5)
    topology.check_primary(Connection(), view(1), lone, written=True, service="s", wait_ms=5)
    with pytest.raises(NotDurable, match="sentinels see 2 up"):
        topology.check_primary(Connection(), view(1, 2), lone, written=True, service="s", wait_ms=5)
    refused = PermissionError("NOPERM")
    with pytest.raises(PermissionError):
        topology.check_primary(
            Connection(), view(1), refused, written=False, service="s", wait_ms=5
        )


def test_hello_says_the_mode_and_the_client_id() -> None:
    """HELLO's mode says cluster or not; its id names the connection, if a positive integer."""
    assert topology.in_cluster_mode(Connection(hello={"mode": "cluster"}))
    assert topology.in_cluster_mode(Connection(hello={b"mode": b"cluster"}))
    assert not topology.in_cluster_mode(Connection(hello={"mode": "standalone"}))
    assert not topology.in_cluster_mode(Connection(hello=None))
    assert topology.identity(Connection(hello={"id": 12})) == "12"
    assert topology.identity(Connection(hello={b"id": 7})) == "7"
    forged: list[Any] = [{"id": 0}, {"id": "12"}, {"id": True}, [], None]
    for hello in forged:
        assert topology.identity(Connection(hello=hello)) == ""


def test_a_plain_uri_found_on_a_cluster_switches_or_is_refused() -> None:
    """TCP and database 0: the cluster URI it stands for; a unix socket or database 3: 78."""
    assert topology.cluster_seed(settings_of("rediss://[::1]:7000")) == (
        ("::1", 7000),
        "rediss+cluster://[::1]:7000",
    )
    assert topology.cluster_seed(settings_of("redis://h")) == (
        ("h", 6379),
        "redis+cluster://h:6379",
    )
    for text, words in (("unix:///s.sock", "a unix socket"), ("redis://h/3", "database 3")):
        with pytest.raises(ConfigError, match=words):
            topology.cluster_seed(settings_of(text))


def test_an_eviction_policy_that_may_drop_lock_keys_is_warned_of() -> None:
    """A maxmemory with a policy other than noeviction: one warning line; else none."""
    warning = topology.eviction_warning("W", {"maxmemory": "1", "maxmemory-policy": "allkeys-lru"})
    assert warning is not None
    assert warning.startswith("warning: W has maxmemory-policy allkeys-lru")
    assert (
        topology.eviction_warning("W", {"maxmemory": "0", "maxmemory-policy": "allkeys-lru"})
        is None
    )
    assert topology.eviction_warning("W", {"maxmemory": "1"}) is None
    assert topology.eviction_warning("W", {}) is None


def test_sentinel_fields_read_from_a_map_or_a_flat_list() -> None:
    """RESP3 maps and RESP2 lists alike; anything else has no fields."""
    assert topology.field({"flags": "master"}, "flags") == "master"
    assert topology.field(["role", "x", "flags", b"s_down"], "flags") == "s_down"
    assert topology.field(["flags"], "flags") == ""
    assert topology.field(7, "flags") == ""


def test_cluster_slots_name_nodes_that_can_be_reached() -> None:
    """Entries lockrun cannot read are left out; a host of "" is the node asked."""
    reply = [
        [0, 100, ["", 7000, "id"], ["r", "7001"]],
        [101, 200, ["b", "0"], ["c", "99999"]],
        "junk",
        [201, 300, [b"d", b"7002"], ["e"]],
    ]
    assert nodes_in(reply, ("a", 1)) == [("a", 7000), ("r", 7001), ("d", 7002)]
    assert primaries_in(reply, ("a", 1)) == [("a", 7000), ("d", 7002)]
    assert nodes_in("junk", ("a", 1)) == []


# -- what redis-py's errors say --------------------------------------------------------------------


def test_redis_py_errors_become_one_line_without_the_password() -> None:
    """Each error in the table, and a reply no Redis gives, named by its type."""
    from redis import exceptions as errors

    settings = settings_of("redis://u:hunter2@h")
    said = wire.failure(errors.ConnectionError("refused hunter2"), settings, 2.0)
    assert isinstance(said, BackendUnavailable)
    assert "hunter2" not in str(said)
    assert str(wire.failure(errors.TimeoutError("slow"), settings, 2.0)).endswith(
        "no answer within 2s (slow)"
    )
    assert isinstance(
        wire.failure(errors.ResponseError("DB index is out of range"), settings, 1), ConfigError
    )
    assert "read-only replica" in str(wire.failure(errors.ReadOnlyError("x"), settings, 1))
    assert str(wire.failure(KeyError("k"), settings, 1)).endswith("is not Redis's (KeyError)")
    other = wire.failure(errors.RedisError(""), settings, 1)
    assert isinstance(other, LockrunError)
    assert str(other).endswith(": RedisError")


def test_commands_are_packed_as_resp_arrays() -> None:
    """*N, then $LEN and the bytes of each word."""
    assert wire.command("GET", "k", 5) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$1\r\n5\r\n"
    assert wire.command("SET", "é") == b"*2\r\n$3\r\nSET\r\n$2\r\n\xc3\xa9\r\n"
