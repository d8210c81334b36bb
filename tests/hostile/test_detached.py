"""Leases kept with no process (acquire --no-keeper) against forged tokens and tampered keys.

A lease token travels through CI logs, job outputs and artifacts, and its lease lives in keys
that any client of the Redis may write. Whatever the token or the keys say: one line, a
documented status (64 malformed, 69 a key of the wrong type, 76 no lease, 78 the wrong
service), never 70, and never a release of a lease the token does not name
(docs/semantics.md "Holding a lock across steps").
"""

from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from lockrun import ExitCode, Lock
from lockrun.backends import parse_uri
from lockrun.backends.redis import connect, key_prefix
from lockrun.cli import SUBCOMMANDS, _exit_status
from lockrun.detached import LeaseToken, acquire, parse_token, release, renew
from lockrun.errors import ConfigError, LockrunError, UsageError
from lockrun.names import MAX_NAME_BYTES
from lockrun.runner import Options
from tests.support.cli import lockrun, one_line, taken

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

SHELL_SAFE = re.compile(r"[A-Za-z0-9._-]+")
TTL = 10.0


@pytest.fixture
def co_tenant(redis_uri: str) -> Iterator[redis.Redis]:
    """Return a client of the session's Redis: another client's, free to write any key."""
    client = redis.Redis.from_url(redis_uri, decode_responses=True)
    yield client
    client.close()


def kept(uri: str, name: str, *, hold: float = 0.0) -> str:
    """Take *name* with --no-keeper, in this process, and return the token it printed."""
    tokens: list[str] = []
    options = Options(name=name, uri=uri, ttl=TTL, hold_at_least=hold)
    assert acquire(options, tokens.append, log=lambda _line: None) == 0
    return tokens[0]


def outcome(asking: Callable[[str, str], str], token: str, uri: str) -> int:
    """Return the exit status of renewing or releasing *token*; only lockrun's errors may come."""
    try:
        asking(token, uri)
    except LockrunError as err:
        status, said = err.exit_code, str(err)
    else:
        return 0
    assert status != ExitCode.SOFTWARE, said
    assert "\n" not in said
    return status


names = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), min_size=1
).filter(lambda text: len(text.encode()) <= MAX_NAME_BYTES)


@given(
    namespace=names,
    name=names,
    lease_id=st.text("0123456789abcdef", min_size=20, max_size=20),
    ttl_ms=st.integers(1000, 86_400_000),
    mode=st.sampled_from(["exclusive", "shared", "slots", "hold"]),
    number=st.integers(1, 1000),
)
def test_every_token_is_shell_safe_and_reads_back(
    namespace: str, name: str, lease_id: str, ttl_ms: int, mode: str, number: int
) -> None:
    """Any names, modes and numbers acquire prints: letters, digits, . _ - only; read back."""
    slots = number if mode == "slots" else 1
    hold = number * 1000 if mode == "hold" else 0
    token = LeaseToken("0123abcd", lease_id, mode == "shared", slots, ttl_ms, hold, namespace, name)
    text = str(token)
    assert SHELL_SAFE.fullmatch(text)
    assert shlex.quote(text) == text
    assert parse_token(text) == token


GOOD = "lrl1.0123abcd.0123456789abcdef0123.x1.10000.0.ZGVmYXVsdA.ZGVwbG95"
MALFORMED = [
    "",
    "lrl1",
    GOOD.replace("lrl1.", "lrl2."),
    GOOD.replace("lrl1.", "lr1."),
    GOOD.upper(),
    GOOD + "\n",
    GOOD + ".x",
    GOOD.replace(".x1.", ".x0."),  # no slots
    GOOD.replace(".x1.", ".x1001."),
    GOOD.replace(".x1.", ".s2."),  # readers share one slot
    GOOD.replace(".x1.10000.0.", ".x2.10000.5000."),  # a window keeps one slot
    GOOD.replace(".x1.10000.0.", ".s1.10000.5000."),  # ... of a writer
    GOOD.replace(".10000.", ".999."),  # under a second
    GOOD.replace(".10000.", ".86400001."),  # over a day
    GOOD.replace(".10000.", ".010000."),
    GOOD.replace(".0.ZGVm", ".31622400001.ZGVm"),  # a window over a year
    GOOD.replace("ZGVwbG95", "QR"),  # "A", but not its one spelling (QQ)
    GOOD.replace("ZGVwbG95", "ZGVwbG9"),  # a length base64 has no decoding for
    GOOD.replace("ZGVwbG95", "_w"),  # 0xff: not UTF-8
    GOOD.replace("ZGVwbG95", "AA"),  # a NUL
    GOOD.replace("ZGVwbG95", "QUFB" * 85 + "QQ"),  # 256 bytes
    GOOD.replace("ZGVwbG95", "ZGVw+G95"),  # base64, not base64url
    GOOD.replace("ZGVwbG95", "ZGVwbG95$(id)"),
    "\x1b[2J" + GOOD,
]


def test_a_malformed_token_is_a_usage_error() -> None:
    """Junk, near misses and non-canonical spellings: 64, one line that does not echo it."""
    assert parse_token(GOOD).name == "deploy"
    for text in MALFORMED:
        with pytest.raises(UsageError, match="malformed token: expected lrl1"):
            parse_token(text)
    for verb in ("release", "renew"):
        result = lockrun(verb, "--uri", "redis://127.0.0.1:1/0", MALFORMED[-1])
        assert (result.returncode, result.stdout) == (64, "")
        assert "malformed token" in one_line(result.stderr)
        assert "\x1b" not in result.stderr


def test_a_token_of_no_lease_another_lock_or_another_service(redis_uri: str, name: str) -> None:
    """76 with no lease, 78 through another service's URI, 0 through another spelling of it."""
    token = parse_token(kept(redis_uri, name))
    nobody = str(token._replace(lease_id="0" * 20))
    other_lock = str(token._replace(name=f"{name}-other"))
    for each in (nobody, other_lock):
        for asking in (renew, release):
            assert outcome(asking, each, redis_uri) == ExitCode.LOST
    elsewhere = str(token._replace(service="00000000", lease_id="0" * 20))
    with pytest.raises(ConfigError, match="not where `acquire --no-keeper` took it"):
        release(elsewhere, redis_uri)
    kept_by = r"kept by a lock service \(redis:// or etcd://\), .* is file: \(the default"
    with pytest.raises(ConfigError, match=kept_by):
        release(str(token), "file:")
    assert taken(redis_uri, name)
    spelled = respelled(redis_uri)
    assert renew(str(token), spelled).startswith(f"{name} is held")
    assert release(str(token), spelled) == f"released {name}"
    assert not taken(redis_uri, name)


def respelled(uri: str) -> str:
    """Return *uri* written otherwise: the host in capitals, or a ./ in the socket's path."""
    parts = urlsplit(uri)
    if parts.scheme == "unix":
        head, _, tail = parts.path.rpartition("/")
        return urlunsplit(parts._replace(path=f"{head}/./{tail}"))
    return urlunsplit(parts._replace(netloc=parts.netloc.upper()))


def test_a_service_is_one_place_however_its_uri_is_spelled() -> None:
    """Credentials, the default port and database, case and order do not move the place."""
    spellings = [
        ["redis://h", "redis://H:6379/0", "redis://u:pw@h?db=0", "rediss://:pw@h:6379"],
        ["redis://h:6380", "redis://h:6380/0"],
        ["redis://h/1", "redis://h?db=1"],
        ["unix:///run/redis.sock", "unix:///run/./redis.sock?db=0&password=pw"],
        ["redis+sentinel://a,b:26380/svc", "redis+sentinel://B:26380,A:26379/svc/0"],
        ["redis+sentinel://a,b:26380/other"],
    ]
    places = [{connect(parse_uri(uri)).place() for uri in group} for group in spellings]
    assert all(len(group) == 1 for group in places)
    assert len(set().union(*places)) == len(spellings)
    assert not any("pw" in place or "u:" in place for group in places for place in group)


def test_a_token_cannot_name_a_lease_that_a_process_holds(
    redis_uri: str, name: str, co_tenant: redis.Redis
) -> None:
    """The id of a run's (or keeper's) lease in a token names no lease: 76, and it stays held."""
    ours = kept(redis_uri, f"{name}-kept")  # a token of this service, to forge from
    lock = Lock(name, uri=redis_uri, ttl=TTL)
    with lock:
        (held,) = co_tenant.zrange(f"{key_prefix('default', name)}:holders", 0, -1)
        forged = str(parse_token(ours)._replace(lease_id=str(held), name=name))
        for asking in (renew, release):
            assert outcome(asking, forged, redis_uri) == ExitCode.LOST
        assert taken(redis_uri, name)
    lock.close()
    release(ours, redis_uri)


# What another client of the Redis may do to a kept lease's keys, and what renew (then
# release) may answer: 0, 69 (a key of another type) or 76 (no lease), never 70.
TAMPERINGS: dict[str, tuple[Callable[[redis.Redis, str, str], object], set[int]]] = {
    "lease deleted": (lambda r, p, t: r.zrem(f"{p}:holders", t), {76}),
    "all keys deleted": (lambda r, p, _t: r.delete(*r.keys(f"{p}:*")), {76}),
    "expiry +inf": (lambda r, p, t: r.zadd(f"{p}:holders", {t: "+inf"}), {0}),
    "expiry in the past": (lambda r, p, t: r.zadd(f"{p}:holders", {t: 1}), {76}),
    "owners junk": (lambda r, p, t: r.hset(f"{p}:owners", t, "x y z"), {0}),
    "owners a window": (lambda r, p, t: r.hset(f"{p}:owners", t, "0 1 2 9" * 3), {76}),
    "owners a string": (lambda r, p, _t: (r.delete(f"{p}:owners"), r.set(f"{p}:owners", 1)), {69}),
    "holders a list": (
        lambda r, p, _t: (r.delete(f"{p}:holders"), r.lpush(f"{p}:holders", 1)),
        {69},
    ),
    "info junk": (lambda r, p, t: r.hset(f"{p}:info", t, "\x00{"), {0}),
    "slots junk": (lambda r, p, _t: r.set(f"{p}:n", "-1e999"), {0}),
    "stop junk": (lambda r, p, _t: r.set(f"{p}:stop", "x"), {0}),
    "stop a hash": (lambda r, p, _t: r.hset(f"{p}:stop", "a", "b"), {0}),
}


@pytest.mark.parametrize("tampering", sorted(TAMPERINGS))
def test_keys_another_client_rewrote(
    redis_uri: str, name: str, co_tenant: redis.Redis, tampering: str
) -> None:
    """Renew, then release, a tampered lease: the documented status for it, never 70."""
    token = kept(redis_uri, name, hold=0.5)
    prefix = key_prefix("default", name)
    tamper, expected = TAMPERINGS[tampering]
    tamper(co_tenant, prefix, f"d:{parse_token(token).lease_id}")
    renewed = outcome(renew, token, redis_uri)
    assert renewed in expected
    released = outcome(release, token, redis_uri)
    assert released == renewed
    if left := co_tenant.keys(f"{prefix}:*"):  # a window, or keys of the wrong type
        co_tenant.delete(*left)


def server_ms(client: redis.Redis) -> int:
    """Return the Redis server's clock in ms (TIME), which its leases run on."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.mark.parametrize("late_ms", [-40, -5, 0, 5])
def test_renew_and_release_racing_the_expiry(
    redis_uri: str, name: str, co_tenant: redis.Redis, late_ms: int
) -> None:
    """A renewal as the lease ends: a whole ttl more, or 76 once it ended; release agrees."""
    token = kept(redis_uri, name)
    holders = f"{key_prefix('default', name)}:holders"
    lease = f"d:{parse_token(token).lease_id}"
    ends = server_ms(co_tenant) - late_ms  # the lease ends late_ms ago (or from now, if < 0)
    co_tenant.zadd(holders, {lease: ends}, xx=True)
    before = server_ms(co_tenant)
    renewed = outcome(renew, token, redis_uri)
    after = server_ms(co_tenant)
    if renewed == 0:  # asked before the end, and a whole ttl from then
        assert before < ends
        assert (co_tenant.zscore(holders, lease) or 0) >= before + TTL * 1000
        assert taken(redis_uri, name)
    else:  # found gone, as it was by the time the answer came
        assert renewed == ExitCode.LOST
        assert after >= ends
    assert outcome(release, token, redis_uri) == renewed
    assert not taken(redis_uri, name)


def run_cli(*args: str) -> int:
    """Return the exit status of ``lockrun ARGS``, run in this process (no start-up to wait)."""
    command, *rest = args
    return _exit_status(SUBCOMMANDS[command][0], f"lockrun {command}", rest)


def test_no_keeper_refuses_what_needs_a_process(
    redis_uri: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--no-keeper with --owner, --max-time, a default --ttl, or a service with no leases: 64."""
    for options, said in (
        (["--owner", "1"], "--owner is kept by a keeper"),
        (["--max-time", "1h"], "--max-time is kept by a keeper"),
        ([], "give --ttl"),
        (["--uri", "file:"], "a file: lock ends with its holder"),
        (["--uri", "postgresql://h/db"], "a postgresql: lock ends with its holder"),
    ):
        uri = ["--uri", redis_uri] if "--uri" not in options else []
        ttl = ["--ttl", "1m"] if options != [] else []
        status = run_cli("acquire", "--no-keeper", *uri, *ttl, *options, name)
        assert status == ExitCode.USAGE, options
        assert said in one_line(capsys.readouterr().err)
    result = lockrun("acquire", "--no-keeper", "--ttl", "1m", "--uri", "abstract:", name)
    assert (result.returncode, result.stdout) == (64, "")
    assert "drop --no-keeper, and a keeper holds it" in one_line(result.stderr)
    assert not taken(redis_uri, name)
