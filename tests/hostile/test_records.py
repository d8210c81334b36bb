"""Records another client of the same server writes: read as untrusted, on every backend.

A co-tenant of a Redis, MySQL or PostgreSQL server can write lockrun's keys, rows and
statement comments. Whatever they write, lockrun never exits 70, never prints a traceback,
keeps its fences 64-bit and rising, and does not refuse a run over numbers no lockrun wrote.
The oracle is the exit status, the one line, and LOCKRUN_FENCE as the command saw it.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import psycopg
import pymysql
import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pymysql.constants import COMMAND
from redis.cluster import RedisCluster

from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.mysql import lock_key as mysql_key
from lockrun.backends.mysql import parse as mysql_parse
from lockrun.backends.postgres import lock_key as postgres_key
from lockrun.backends.postgres import slots_key
from lockrun.backends.redis import key_prefix
from lockrun.bounds import MAX_FENCE
from lockrun.timing import now
from tests.support.cli import Held, clean, lockrun, statuses_read, wait_for
from tests.support.net import mysql_query as query
from tests.support.strategies import deep, holder_like, json_values

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.support.clusters import Cluster


def fence_of_run(uri: str, name: str) -> int:
    """Run a command under *name*; return the LOCKRUN_FENCE it printed, checked 64-bit."""
    result = lockrun("--uri", uri, "-n", name, "--", "sh", "-c", 'echo "$LOCKRUN_FENCE"')
    assert result.returncode == 0, result.stderr
    fence = int(result.stdout)
    assert 0 < fence <= MAX_FENCE
    return fence


# -- Redis ----------------------------------------------------------------------------------


@pytest.fixture
def redis_client(redis_uri: str) -> Iterator[redis.Redis]:
    """Return a client of the session's Redis: the co-tenant's."""
    client = redis.Redis.from_url(redis_uri, decode_responses=True)
    yield client
    client.close()


REDIS_PLANTS: dict[str, list[tuple[str, str, object]]] = {
    "n-not-a-number": [("n", "set", "abc")],
    "n-out-of-bounds": [("n", "set", "99999999")],
    "fence-not-a-number": [("fence", "set", "ten")],
    "fence-past-2^53": [("fence", "set", str(2**63 - 2))],
    "ticket-not-a-number": [("ticket", "set", "x")],
    "owners-garbage": [("owners", "hset", {"tok": "not a slot", "t2": "999999999999 x y"})],
    "info-garbage": [("info", "hset", {"tok": deep(5000), "t2": '{"pid": "x"}', "t3": "ÿ"})],
}


@pytest.mark.parametrize("plant", sorted(REDIS_PLANTS))
def test_redis_keys_written_by_another_client_change_no_decision(
    redis_uri: str, redis_client: redis.Redis, name: str, plant: str
) -> None:
    """Garbage in n, fence, ticket, owners or info: runs go on, fences stay 64-bit."""
    before = fence_of_run(redis_uri, name)
    prefix = key_prefix("default", name)
    for key, kind, value in REDIS_PLANTS[plant]:
        if kind == "set":
            redis_client.set(f"{prefix}:{key}", str(value))
        else:
            redis_client.hset(f"{prefix}:{key}", mapping=value)  # type: ignore[arg-type]
    after = fence_of_run(redis_uri, name)
    assert after > before  # a counter no lockrun wrote is seeded from the clock again
    statuses_read(redis_uri, name)
    semaphore = lockrun("--uri", redis_uri, "-n", name, "-s", "3", "--", "true")
    clean(semaphore, 0)


def test_a_ghost_holder_of_another_client_is_a_holder_not_a_crash(
    redis_uri: str, redis_client: redis.Redis, name: str
) -> None:
    """A token with no record, leased till +inf: busy (75) in one line, -v and status read."""
    prefix = key_prefix("default", name)
    redis_client.zadd(f"{prefix}:holders", {"ghost": float("inf")})
    redis_client.hset(f"{prefix}:owners", "ghost", "0 1 1")
    redis_client.set(f"{prefix}:n", "1")
    try:
        busy = lockrun("--uri", redis_uri, "-n", name, "-w", "0", "--", "true")
        clean(busy, 75)
        verbose = lockrun("-v", "--uri", redis_uri, "-n", name, "-w", "1", "--", "true")
        assert verbose.returncode == 75
        assert "Traceback" not in verbose.stderr
        statuses_read(redis_uri, name)
    finally:
        redis_client.delete(*(f"{prefix}:{part}" for part in ("holders", "owners", "n")))


def test_a_lock_key_of_the_wrong_type_is_69_saying_so(
    redis_uri: str, redis_client: redis.Redis, name: str
) -> None:
    """Holders written as a string: 69, one line naming WRONGTYPE; status the same."""
    prefix = key_prefix("default", name)
    redis_client.set(f"{prefix}:holders", "not a sorted set")
    try:
        result = lockrun("--uri", redis_uri, "-n", name, "--", "true")
        clean(result, 69)
        assert "WRONGTYPE" in result.stderr
        shown = lockrun("status", "--uri", redis_uri, name)
        clean(shown, 69)
    finally:
        redis_client.delete(f"{prefix}:holders")


def test_records_another_client_of_a_cluster_writes_change_no_decision(
    redis_cluster: Cluster, name: str
) -> None:
    """On a cluster: garbage keys, then a ghost holder, then a key of the wrong type.

    Garbage in n, fence and owners: runs go on with 64-bit fences that rise; a token
    leased till +inf: busy (75) in one line; holders written as a string: 69 naming
    WRONGTYPE. Status reads each, without NAME too (a scan of every primary).
    """
    uri, prefix = redis_cluster.uri, key_prefix("default", name)
    address = redis_cluster.uri.removeprefix("redis+cluster://").split(",")[0]
    host, port = address.rsplit(":", 1)
    client = RedisCluster(host=host, port=int(port), decode_responses=True)
    try:
        before = fence_of_run(uri, name)
        client.set(f"{prefix}:n", "abc")
        client.set(f"{prefix}:fence", str(2**63 - 2))
        client.hset(f"{prefix}:owners", mapping={"tok": "not a slot", "t2": "9 x y"})
        assert fence_of_run(uri, name) > before
        statuses_read(uri, name)
        client.zadd(f"{prefix}:holders", {"ghost": float("inf")})
        client.hset(f"{prefix}:owners", "ghost", "0 1 1")
        clean(lockrun("--uri", uri, "-n", name, "-w", "0", "--", "true"), 75)
        statuses_read(uri, name)
        client.delete(f"{prefix}:holders")
        client.set(f"{prefix}:holders", "not a sorted set")
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        clean(result, 69)
        assert "WRONGTYPE" in result.stderr
    finally:
        client.delete(*(f"{prefix}:{part}" for part in ("holders", "owners", "n", "fence")))
        client.close()


redis_values = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.builds(json.dumps, holder_like()),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=redis_values,
    fence=redis_values,
    owners=st.dictionaries(st.text(min_size=1, max_size=8), redis_values, max_size=3),
    info=st.dictionaries(st.text(min_size=1, max_size=8), redis_values, max_size=3),
)
def test_redis_records_from_anyone_never_break_an_acquisition(
    redis_uri: str,
    redis_client: redis.Redis,
    n: str,
    fence: str,
    owners: dict[str, str],
    info: dict[str, str],
) -> None:
    """Random n, fence, owners and info: a lease with a 64-bit fence, and a status; no error."""
    name = f"t-prop-{time.monotonic_ns()}"
    prefix = key_prefix("default", name)
    redis_client.set(f"{prefix}:n", n)
    redis_client.set(f"{prefix}:fence", fence)
    for key, mapping in (("owners", owners), ("info", info)):
        if mapping:
            redis_client.hset(f"{prefix}:{key}", mapping=dict(mapping))  # type: ignore[arg-type]
    backend = open_backend(parse_uri(redis_uri), ttl=5.0)
    try:
        lease = backend.acquire(Request("default", name, 1, 5.0, Holder.me(["x"])), now())
        assert lease is not None
        assert lease.fence is not None
        assert 0 < lease.fence <= MAX_FENCE
        backend.status("default", name)
        backend.status("default", None)
        lease.release()
    finally:
        backend.close()
        redis_client.delete(*(f"{prefix}:{part}" for part in ("n", "fence", "owners", "info")))


# -- MySQL / MariaDB ------------------------------------------------------------------------


# One record end to end; what the decoders make of any record, deep, huge or null
# included, is tests/unit/test_mysql_rows.py's.
def test_mysql_holder_rows_rewritten_by_another_client_are_shown_not_believed(
    mysql_uri: str, held: Callable[..., Held], name: str
) -> None:
    """A live holder's row with junk JSON and --slots 4e9: busy is 75, not 78 or 70."""
    record = '{"pid": "x", "host": [], "user": null}'
    holder = held("--uri", mysql_uri, "-n", name)
    key = mysql_key("default", name)
    query(
        mysql_uri,
        "UPDATE lockrun_holders SET holder = %s, slots = 4000000000 WHERE lock_key = %s",
        (record, key),
    )
    busy = lockrun("--uri", mysql_uri, "-n", name, "-w", "0", "--", "true")
    clean(busy, 75)
    statuses_read(mysql_uri, name)
    holder.finish()


def test_a_mysql_fence_counter_at_its_maximum_starts_again_from_the_clock(
    mysql_uri: str, name: str
) -> None:
    """lockrun_fence at 2^64-1 (fence + 1 would overflow): a fence below 2^63, no 70."""
    fence_of_run(mysql_uri, name)
    key = mysql_key("default", name)
    for planted in (2**64 - 1, 2**63 - 1, 2**63 + 5):
        query(mysql_uri, "UPDATE lockrun_fence SET fence = %s WHERE lock_key = %s", (planted, key))
        fence = fence_of_run(mysql_uri, name)
        assert fence > time.time() * 1e6 - 60e6  # seeded from the clock again
    following = fence_of_run(mysql_uri, name)
    assert following > fence


# One comment end to end, one that would make status probe 99999 slots if believed; what
# the decoder makes of any comment is tests/unit/test_mysql_rows.py's.
def test_a_forged_get_lock_comment_in_the_processlist_is_read_as_untrusted(
    mysql_uri: str, held: Callable[..., Held], name: str
) -> None:
    """Another session waits with a /* lockrun … */ comment of its own: status reads on."""
    comment = (
        '{"token": "t", "namespace": "default", "name": "N", "slots": 99999,'
        ' "holder": {"host": "h", "pid": 1, "user": "u"}}'
    )
    holder = held("--uri", mysql_uri, "-n", name)
    lock = f"{mysql_key('default', name)}:0"
    forged = comment.replace('"N"', json.dumps(name))
    connection = pymysql.connect(**mysql_parse(parse_uri(mysql_uri)).kwargs, autocommit=True)
    try:
        # Sent, not awaited: it waits in GET_LOCK's queue, its comment in the processlist.
        statement = f"SELECT GET_LOCK('{lock}', 30) /* lockrun {forged} */"
        connection._execute_command(COMMAND.COM_QUERY, statement)  # type: ignore[attr-defined]
        wait_for(lambda: waiting_in_processlist(mysql_uri, lock), what="the forged waiter")
        statuses_read(mysql_uri, name)
        busy = lockrun("--uri", mysql_uri, "-n", name, "-w", "0", "--", "true")
        clean(busy, 75)
    finally:
        connection.close()  # ends the forged wait
        holder.finish()


def waiting_in_processlist(uri: str, lock: str) -> bool:
    """Whether a session waits in GET_LOCK for *lock*, as the processlist shows."""
    rows = query(
        uri,
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE %s",
        (f"%{lock}%",),
    )
    return bool(rows[0][0])


# -- PostgreSQL -----------------------------------------------------------------------------


def test_a_forged_postgres_session_comment_is_read_as_untrusted(
    postgres_uri: str, name: str
) -> None:
    """Another client holds the slot under a /* lockrun {junk} */ comment: 75, status reads."""
    key = postgres_key("default", name, 0)
    with psycopg.connect(postgres_uri, autocommit=True) as other:
        other.execute(f"/* lockrun {deep(20_000)[:900]} */ SELECT pg_advisory_lock({key})")
        other.execute('/* lockrun {"token": 1, "slots": 5000, "holder": []} */ SELECT pg_sleep(0)')
        busy = lockrun("--uri", postgres_uri, "-n", name, "-w", "0", "--", "true")
        clean(busy, 75)
        statuses_read(postgres_uri, name)


def test_a_postgres_agreement_lock_with_an_impossible_n_is_no_mismatch(
    postgres_uri: str, name: str
) -> None:
    """(key, 5000) held by someone: no lockrun takes such an N, so it refuses nothing."""
    with psycopg.connect(postgres_uri, autocommit=True) as other:
        other.execute(
            "SELECT pg_advisory_lock_shared(%s::int, 5000)", (slots_key("default", name),)
        )
        result = lockrun("--uri", postgres_uri, "-n", name, "--", "true")
        assert (result.returncode, result.stderr) == (0, "")


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=json_values | holder_like())
@example(record={"/*": None})  # a /* would open a comment nested in lockrun's
def test_postgres_comments_from_anyone_never_break_status(
    postgres_uri: str, record: object
) -> None:
    """A session of anyone's, whose statement carries any JSON as a lockrun comment."""
    name = f"t-prop-{time.monotonic_ns()}"
    # "\u002a" is JSON's "*" (only strings hold one): no */ can end the comment early, nor
    # /* open one nested in it.
    text = json.dumps(record).replace("*", "\\u002a")
    backend = open_backend(parse_uri(postgres_uri), ttl=5.0)
    with psycopg.connect(postgres_uri, autocommit=True) as other:
        other.execute(
            f"/* lockrun {text} */ SELECT pg_advisory_lock({postgres_key('default', name, 0)})"
        )
        try:
            [state] = backend.status("default", name)
            assert len(state.holders) == 1
            backend.status("default", None)
        finally:
            backend.close()
