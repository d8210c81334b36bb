"""Redis: a first-in first-out lease semaphore in Lua (docs/design.md A4).

Every lock is a handful of keys under one hash tag, ``lockrun:{NS/NAME}:…``, so Redis
Cluster keeps them in one slot. Holders are a sorted set of acquisition tokens scored by
lease expiry on the *server's* clock; waiters queue in a sorted set by ticket and each
blocks in BLPOP on its own wake list, which the scripts push to when a slot is the
waiter's to take. Every script is idempotent per token (redis-py and networks retry), reaps
the leases and waits that ran out, and sets a TTL on every key, so a crashed holder or
waiter blocks nobody beyond its lease and nothing stays behind after the last user.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import select
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis import exceptions as errors
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from lockrun.backends import (
    Holder,
    LockState,
    Request,
    host_port,
    read_json,
    readable_file,
    slots_mismatch,
    timeout_for,
)
from lockrun.backends.cluster import NotDurable, Router, Unsettled, check_durable, slot_of
from lockrun.backends.resp import bound, within
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    Interrupted,
    LeaseLost,
    LockrunError,
    TakenOver,
)
from lockrun.timing import DEFAULT_TTL, RECONNECT_INTERVAL, now
from lockrun.uri import Secrets, option_name, scrub, secrets_of

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from redis.typing import EncodableT

    from lockrun.uri import LockURI

DEFAULT_PORT: Final = 6379
_DROP_ROUNDS: Final = 8  # dead waiters passed over per release, 1 or more at a time
SENTINEL_PORT: Final = 26379
PREFIX: Final = "lockrun"
_TLS_OPTIONS: Final = frozenset(
    {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
)
_TLS_FILES: Final = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
_OPTIONS: Final = {
    "redis": frozenset({"db"}),
    "rediss": frozenset({"db"}) | _TLS_OPTIONS,
    "unix": frozenset({"db", "username", "password"}),
    "redis+sentinel": frozenset({"db", "sentinel_username", "sentinel_password"}) | _TLS_OPTIONS,
    "redis+cluster": frozenset(),
    "rediss+cluster": _TLS_OPTIONS,
}
CLUSTER_SCHEMES: Final = frozenset({"redis+cluster", "rediss+cluster"})
_KEY_UNSAFE: Final = re.compile(r"[%/{}\s\x00-\x1f\x7f*?\[\]\\]")


# -- the scripts -----------------------------------------------------------------------------
# KEYS: holders queue waiters ticket fence owners info n clients stop (docs/backends.md "Redis")
# ARGV: key prefix, token, N, lease ms, then per script: acquire: holder JSON, mode (try, wait
# or take: a wait with --take-over), our connection's CLIENT ID; release: the hold in ms;
# drop: the {token, CLIENT ID} pairs of the dead.
# A token that starts with "s:" asks for, or holds, the lock shared (--shared): the mode
# travels with the token through every key, and nobody can write a mode that is not one.
# Numbers reach Lua as strings and leave it as doubles: a fence is formatted with %d before it
# is stored, because Lua's own tostring() would round a 16-digit integer (docs/design.md P27).
# Every redis.call costs the server about half a microsecond: the common cases (a free lock
# taken, the only holder leaving with nobody waiting) come first in each script and make only
# the calls their outcome needs; everything else takes the general path below them.

_PRELUDE: Final = (
    f"local MAX_SLOTS = {MAX_SLOTS}\n"
    f"local MAX_WINDOW = {round(MAX_WAIT * 1000)}  -- ms: the longest --hold-at-least\n"
    """
local holders, queue, waiters, ticket, fence, owners, info, cfg, clients, stop = unpack(KEYS)
local prefix, token, n, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local MAX_FENCE = 9007199254740992  -- 2^53: Lua's doubles are exact below, and no further
local DAY = 86400000  -- ms; the fence outlives the lock's other keys by this much

-- How long the lock's keys live when its last lease, window or place runs out at *last*: a
-- minute more (last may be +inf, written by another client: then the longest window).
local function lifetime(last)
  return math.min(math.floor(last - now), MAX_WINDOW) + 60000
end

local function is_shared(who)
  return string.sub(who, 1, 2) == 's:'
end

-- The next fence: one more than the last, raised to the server's clock in µs when lower
-- (Redis lost the counter) or when it is no counter lockrun wrote.
local function next_fence()
  local counted = redis.pcall('INCR', fence)  -- fails on a counter that is no integer
  local stamp = type(counted) == 'number' and counted or MAX_FENCE
  local micros = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  if stamp < micros or stamp >= MAX_FENCE then
    stamp = micros
    redis.call('SET', fence, string.format('%d', stamp))
  end
  return stamp
end
"""
)

# The general path: what every script but the fast paths shares.
_MACHINERY: Final = """
-- Another client of this server may have written any key: read numbers defensively.
local function configured_n()
  local value = tonumber(redis.call('GET', cfg) or '')
  if value and value >= 1 and value <= MAX_SLOTS and value == math.floor(value) then
    return value
  end
  return nil
end

local function forget(tokens)
  if #tokens == 0 then return end
  for _, key in ipairs({holders, queue, waiters}) do redis.call('ZREM', key, unpack(tokens)) end
  for _, key in ipairs({owners, info, clients}) do redis.call('HDEL', key, unpack(tokens)) end
  for _, gone in ipairs(tokens) do redis.call('DEL', prefix .. ':wake:' .. gone) end
end

local function reap()
  forget(redis.call('ZRANGEBYSCORE', holders, '-inf', now))
  forget(redis.call('ZRANGEBYSCORE', waiters, '-inf', now))
end

-- The take-over asked for now (--take-over): the taker's token and record, or nil. Anyone
-- may write the stop key: only "TOKEN RECORD" naming a place in the queue that is still
-- kept counts, so a taker that died or left stops nobody, whatever its key still says.
local function stopper()
  local raw = redis.pcall('GET', stop)  -- another type there is no error, only no request
  if type(raw) ~= 'string' then return nil end
  local who, record = string.match(raw, '^(%S+) (.*)$')
  if not who then return nil end
  local place = tonumber(redis.call('ZSCORE', waiters, who) or '')
  if not place or place <= now or not redis.call('ZSCORE', queue, who) then return nil end
  return who, record
end

-- How many hold the lock exclusively, and how many shared, of *count* holders.
local function census(count)
  local exclusive, shared = 0, 0
  if count == 0 then return exclusive, shared end
  for _, who in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
    if is_shared(who) then shared = shared + 1 else exclusive = exclusive + 1 end
  end
  return exclusive, shared
end

-- Whether *who* may hold beside the holders: a reader beside readers, a writer in a free
-- slot of a lock no reader holds.
local function fits(who, slots, exclusive, shared)
  if is_shared(who) then return exclusive == 0 end
  return shared == 0 and exclusive < slots
end

-- Gives the lowest free slot and the next fence to *who* until *expiry*, keeping its record;
-- a reader shares slot 0 and has no fence. *taker*: a take-over is pending that *who* must
-- give way to when it claims the slot (owners then says "… y:TAKER").
local function grant(who, expiry, taker)
  local slot, stamp = 0, 0
  if not is_shared(who) then
    local used = {}
    for _, owner in ipairs(redis.call('HVALS', owners)) do
      local taken = tonumber(string.match(owner, '^(%d+) ') or '')
      if taken then used[taken] = true end
    end
    while used[slot] do slot = slot + 1 end
    stamp = next_fence()
  end
  local record, client = redis.call('HGET', info, who), redis.call('HGET', clients, who)
  forget({who})
  redis.call('ZADD', holders, expiry, who)
  local owner = string.format('%d %d %d', slot, stamp, now)
  if taker then owner = owner .. ' y:' .. taker end
  redis.call('HSET', owners, who, owner)
  if record then redis.call('HSET', info, who, record) end
  if client then redis.call('HSET', clients, who, client) end
  return slot, stamp
end

-- Grants to the head of the queue, strictly in order while the next one fits (consecutive
-- readers enter together), and wakes those waiters. Each finds its slot granted when it
-- asks again; until then the slot is held only as long as the waiter's place would have
-- been, so a waiter that died frees it on that schedule, or sooner: returns {token, CLIENT
-- ID, …} of those woken, for the caller to see that their connections are still there (DROP).
-- A taker granted ends its take-over request; anyone granted before it gives way.
local function wake(slots)
  local woken = {}
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if not head then return woken end
  local count = redis.call('ZCARD', holders)
  if count >= slots and not is_shared(head) then return woken end  -- the usual: all taken
  local exclusive, shared = census(count)
  local taker = stopper()
  while head and fits(head, slots, exclusive, shared) do
    if is_shared(head) then shared = shared + 1 else exclusive = exclusive + 1 end
    local mark = nil
    if head == taker then
      redis.call('DEL', stop)
      taker = nil
    else
      mark = taker
    end
    grant(head, tonumber(redis.call('ZSCORE', waiters, head)) or now + ttl, mark)
    local key = prefix .. ':wake:' .. head
    redis.call('RPUSH', key, 1)
    redis.call('PEXPIRE', key, ttl)
    woken[#woken + 1] = head
    woken[#woken + 1] = redis.call('HGET', clients, head) or ''
    if exclusive >= slots then break end
    head = redis.call('ZRANGE', queue, 0, 0)[1]
  end
  return woken
end

local function tidy()
  local last = 0
  for _, key in ipairs({holders, waiters}) do
    local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if #top > 0 then last = math.max(last, tonumber(top[2])) end
  end
  if last == 0 then
    redis.call('DEL', holders, queue, waiters, ticket, owners, info, cfg, clients, stop)
    redis.call('PEXPIRE', fence, DAY)
    return
  end
  local keep = lifetime(last)
  for _, key in ipairs({holders, queue, waiters, ticket, owners, info, cfg, clients}) do
    redis.call('PEXPIRE', key, keep)
  end
  redis.call('PEXPIRE', fence, math.max(keep, DAY))
end

-- The next place in the queue; after the last one there, if the counter is not one of ours.
local function next_ticket()
  local counted = redis.pcall('INCR', ticket)
  if type(counted) == 'number' then return counted end
  local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')
  local after = math.floor(math.min(tonumber(last[2]) or 0, MAX_FENCE)) + 1
  redis.call('SET', ticket, string.format('%d', after))
  return after
end

-- Forgets *tokens* and the lapsed, and hands what that freed to who is next: the woken.
local function hand_on(tokens)
  forget(tokens)
  reap()
  local woken = wake(configured_n() or n)
  tidy()
  return woken
end
"""

# → {code, number, number, number, text, then the {token, CLIENT ID} pairs of other waiters
# it woke}: {1, slot, fence (0 for a reader), 0, ''} granted; {0, rank, ms until a lease or
# a place ahead of us may lapse, ms the lock stays taken whatever happens (a --hold-at-least
# window), ''} queued (or, in 'try' mode, not queued); {-1, N in use, 0, 0, ''} when live
# users of the name have another N; {2, 0, 0, 0, the taker's record} granted while a
# take-over was pending: given back at once, for the taker.
_ACQUIRE: Final = (
    _PRELUDE
    + """
-- A free lock: nobody holds or waits, so its keys are gone (tidy() deletes them with the
-- last user, or they expire together). No lease can have lapsed, no waiter is owed a slot,
-- no take-over is pending and no other N is in use: slot 0 is ours, recorded as grant() and
-- tidy() would.
if redis.call('EXISTS', holders, queue) == 0 then
  local keep = lifetime(now + ttl)
  local stamp = 0
  if not is_shared(token) then
    stamp = next_fence()
    redis.call('PEXPIRE', fence, math.max(keep, DAY))
  end
  redis.call('ZADD', holders, now + ttl, token)
  redis.call('HSET', owners, token, string.format('0 %d %d', stamp, now))
  redis.call('HSET', info, token, ARGV[5])
  redis.call('SET', cfg, n, 'PX', keep)
  for _, key in ipairs({holders, owners, info}) do redis.call('PEXPIRE', key, keep) end
  return {1, 0, stamp, 0, ''}
end
"""
    + _MACHINERY
    + """
local mode = ARGV[6]
reap()
local configured = configured_n() or n
if configured ~= n and redis.call('ZCARD', holders) + redis.call('ZCARD', queue) > 0 then
  return {-1, configured, 0, 0, ''}
end
redis.call('SET', cfg, n)
local woken = wake(n)
local function reply(a, b, c, d, text)
  tidy()
  local all = {a, b, c, d, text}
  for i = 1, #woken, 2 do
    if woken[i] ~= token then all[#all + 1], all[#all + 2] = woken[i], woken[i + 1] end
  end
  return all
end
local mine = redis.call('HGET', owners, token)
local slot, stamp, rest = string.match(mine or '', '^(%d+) (%d+) %d+(.*)$')
local taker = string.match(rest or '', '^ y:(%S+)$')
if mine and (not slot or (rest ~= '' and not taker)) then
  -- Not what grant() wrote for a token that asks (a window is a released token's): anew.
  forget({token})
  slot = nil
end
if slot and taker and (redis.call('HEXISTS', owners, taker) == 1
                       or redis.call('ZSCORE', queue, taker)) then
  -- Granted while a take-over was pending, and its taker still waits or holds: it came
  -- after us, so we give way (docs/design.md A4) and hand the slot on, to the taker or to
  -- who is before it. (A taker gone meanwhile leaves us the slot.)
  local record = redis.call('HGET', info, taker) or ''
  for _, each in ipairs(hand_on({token})) do woken[#woken + 1] = each end
  return reply(2, 0, 0, 0, record)
end
if slot then  -- granted while we slept, or a retried call: the lease runs from now
  if taker then redis.call('HSET', owners, token, string.match(mine, '^%d+ %d+ %d+')) end
  redis.call('ZADD', holders, 'XX', now + ttl, token)
  redis.call('HDEL', clients, token)  -- claimed: ours now, whatever becomes of a connection
  return reply(1, tonumber(slot), tonumber(stamp), 0, '')
end
local rank = redis.call('ZRANK', queue, token)
local queued = rank ~= false
if not queued then rank = redis.call('ZCARD', queue) end
if rank == 0 and not queued then  -- nobody queues (wake() ran): we may fit beside the holders
  local exclusive, shared = census(redis.call('ZCARD', holders))
  if fits(token, n, exclusive, shared) then
    redis.call('HSET', info, token, ARGV[5])
    local slot, stamp = grant(token, now + ttl)
    redis.call('HDEL', clients, token)
    return reply(1, slot, stamp, 0, '')
  end
end
if mode ~= 'try' then
  if not queued then redis.call('ZADD', queue, next_ticket(), token) end
  redis.call('ZADD', waiters, now + ttl, token)
  redis.call('HSET', info, token, ARGV[5])
  if ARGV[7] ~= '' then redis.call('HSET', clients, token, ARGV[7]) end
  if mode == 'take' then
    -- Ask the holders to stop (their renewals say so), for as long as our place is kept:
    -- the request lapses with it. A later taker's request replaces ours.
    local taker = stopper()
    if not taker or taker == token then
      redis.call('SET', stop, token .. ' ' .. ARGV[5], 'PX', ttl)
    end
  end
end
-- Sleep at most until the first lease, or the place of a waiter ahead of us, runs out. If
-- the only lease is a window (--hold-at-least), the lock stays taken until it ends.
local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
local until_free, taken = ttl, 0
if #first > 0 then
  local ends = tonumber(first[2])
  until_free = math.min(ttl, ends - now)
  local owner = redis.call('HGET', owners, first[1]) or ''
  if n == 1 and string.find(owner, '^%d+ %d+ %d+ %d') then
    taken = math.min(ends - now, MAX_WINDOW)
  end
end
if mode ~= 'try' and rank > 0 then
  for _, ahead in ipairs(redis.call('ZRANGE', queue, 0, rank - 1)) do
    local lapse = redis.call('ZSCORE', waiters, ahead)
    if lapse then until_free = math.min(until_free, tonumber(lapse) - now) end
  end
end
return reply(0, rank, math.max(0, until_free), math.max(0, taken), '')
"""
)

# → 1 extended, 0 lost, or the taker's record: extended, but a take-over asks us to stop.
# An expired lease is lost even before anyone reaped it, and so is a window (--hold-at-least):
# its run has ended, and a renewal that arrives after the release revives nothing (P4).
_RENEW: Final = (
    _PRELUDE
    + _MACHINERY
    + """
local expiry = redis.call('ZSCORE', holders, token)
if not expiry or tonumber(expiry) <= now then return 0 end
if string.find(redis.call('HGET', owners, token) or '', '^%d+ %d+ %d+ ') then return 0 end
redis.call('ZADD', holders, 'XX', now + ttl, token)
tidy()
local taker, record = stopper()
if taker and taker ~= token then return record end
return 1
"""
)

# Releases a slot or leaves the queue, whichever the token has; grants to who is next.
# ARGV[5]: the hold in ms (--hold-at-least): a slot held is kept taken until the server's
# now + hold, marked as a window in owners ("SLOT FENCE GRANTED UNTIL"), and nothing is
# granted; the head of the queue is woken to sleep until the window ends. A release while
# a take-over is pending leaves no window: the taker asked for the lock now.
# ARGV[6]: '1' if the caller's connection tracked the stop key (a lease's bell): the key is
# then written, which is what ends Redis's tracking of it for every connection that ever
# read it (CLIENT TRACKING OFF does not; a lock's users would pile up in the table).
# → the {token, CLIENT ID} pairs of the waiters it woke.
_RELEASE: Final = (
    _PRELUDE
    + """
local hold = tonumber(ARGV[5] or '')
if not hold or hold ~= hold or hold < 1 then hold = 0 end  -- none, NaN, or under a ms
if ARGV[6] == '1' and redis.call('EXISTS', stop) == 0 then
  redis.call('SET', stop, '', 'PX', 1)  -- no request (stopper() reads none), just a write
end
-- The only holder leaves and nobody waits: nobody is owed the slot, whether or not our
-- lease ran out. The keys go, as tidy() deletes them after the last user.
local first_two = redis.call('ZRANGE', holders, 0, 1)  -- is ours the only lease?
if hold == 0 and #first_two == 1 and first_two[1] == token
    and redis.call('EXISTS', queue) == 0 then
  redis.call('DEL', holders, waiters, ticket, owners, info, cfg, clients, stop,
             prefix .. ':wake:' .. token)
  redis.call('PEXPIRE', fence, DAY)
  return {}
end
"""
    + _MACHINERY
    + """
if hold > 0 then
  local expiry = tonumber(redis.call('ZSCORE', holders, token) or '')
  local mine = redis.call('HGET', owners, token) or ''
  if string.find(mine, '^%d+ %d+ %d+ %d') then return {} end  -- a retry: the window stands
  local taker = stopper()
  if expiry and expiry > now and string.find(mine, '^%d+ %d+ %d+$') and not taker then
    local ends = now + math.min(hold, MAX_WINDOW)
    redis.call('ZADD', holders, 'XX', ends, token)
    redis.call('HSET', owners, token, mine .. string.format(' %d', ends))
    redis.call('HDEL', clients, token)
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if head then  -- a hint (D2): it asks again and learns when the window ends
      local key = prefix .. ':wake:' .. head
      redis.call('RPUSH', key, 1)
      redis.call('PEXPIRE', key, ttl)
    end
    tidy()
    return {}
  end
end
local taker = stopper()
if taker == token then redis.call('DEL', stop) end  -- a taker that gives up
return hand_on({token})
"""
)

# ARGV[5…]: {token, CLIENT ID} pairs of woken waiters whose connections the caller found
# gone. Forgets each that has neither claimed its slot nor asked again (from a new
# connection) since, and grants to who is next. → the pairs it woke.
_DROP: Final = (
    _PRELUDE
    + _MACHINERY
    + """
local dead = {}
for i = 5, #ARGV, 2 do
  local who, client = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', owners, who) and redis.call('HGET', clients, who) == client then
    dead[#dead + 1] = who
  end
end
return hand_on(dead)
"""
)

# Read-only: {server ms, N, holders+expiry, queue, owners, info, waiters+expiry}.
_STATUS: Final = (
    _PRELUDE
    + """
return {now, redis.call('GET', cfg) or '',
        redis.call('ZRANGE', holders, 0, -1, 'WITHSCORES'), redis.call('ZRANGE', queue, 0, -1),
        redis.call('HGETALL', owners), redis.call('HGETALL', info),
        redis.call('ZRANGE', waiters, 0, -1, 'WITHSCORES')}
"""
)

_SCRIPTS: Final = {
    "acquire": _ACQUIRE,
    "renew": _RENEW,
    "release": _RELEASE,
    "drop": _DROP,
    "status": _STATUS,
}
# EVALSHA names a script by the SHA-1 of its text; SCRIPT LOAD where the server lacks it.
_SHA1: Final = {
    name: hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
    for name, text in _SCRIPTS.items()
}


def _command(*words: str | int) -> bytes:
    """Return one command in Redis's protocol (RESP).

    Packed here: redis-py's packer and command machinery cost more than the round trip
    for a script's 18 arguments.
    """
    packed = [b"*%d\r\n" % len(words)]
    for word in words:
        data = str(word).encode()
        packed.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(packed)


def _run(
    connection: Any,  # noqa: ANN401 - redis-py's Connection
    script: str,
    keys: list[str],
    argv: list[Any],
    *after: tuple[str, ...],
    asking: bool = False,
) -> list[Any]:
    """Run *script* on *connection*, then the commands *after*, in one round trip.

    Return their replies; an error reply to one of *after* is returned as the exception.
    A server that lacks the script (a restart, SCRIPT FLUSH, another
    server behind the address) is given it, once. *asking*: ASKING first, for the node a
    cluster's ASK redirected us to.
    """
    packed = b"".join(
        [
            _command("ASKING") if asking else b"",
            _command("EVALSHA", _SHA1[script], len(keys), *keys, *argv),
            *(_command(*c) for c in after),
        ]
    )
    for _attempt in range(2):
        connection.send_packed_command([packed])  # a list of chunks, as pack_command gives
        try:
            if asking:
                connection.read_response()  # OK
            reply = connection.read_response()
        except errors.NoScriptError:
            for _ in after:  # their replies, before the connection is used again
                _reply(connection)
            connection.send_packed_command([_command("SCRIPT", "LOAD", _SCRIPTS[script])])
            connection.read_response()
            continue
        except errors.ResponseError:
            for _ in after:  # the connection stays in step, then the error is reported
                _reply(connection)
            raise
        return [reply, *(_reply(connection) for _ in after)]
    msg = "the server forgot our script as soon as it was loaded"
    raise errors.ConnectionError(msg)


# Client-side caching's tracking, for a lease's take-over bell (`RedisBackend.track`).
_TRACK: Final = (("CLIENT", "TRACKING", "ON", "OPTIN"), ("CLIENT", "CACHING", "yes"))


def _reply(connection: Any) -> Any:  # noqa: ANN401 - redis-py's Connection, and any reply
    """Read one reply; an error reply (a refused command) is returned, not raised.

    Its whole reply has been read, so the connection stays in step for the next.
    """
    try:
        return connection.read_response()
    except errors.ResponseError as refused:
        return refused


def _pipeline(connection: Any, *commands: tuple[str, ...]) -> list[Any]:  # noqa: ANN401
    """Send *commands* in one round trip; return their replies (errors as values, `_reply`)."""
    connection.send_packed_command([b"".join(_command(*command) for command in commands)])
    return [_reply(connection) for _ in commands]


# -- URIs --------------------------------------------------------------------------------------


class Settings(NamedTuple):
    """Where the server is and how to log in: a redis:, rediss:, unix:, sentinel or cluster URI."""

    where: str  # the URI without its password, for messages
    kwargs: Mapping[str, Any]  # for redis.Redis, or for Sentinel.master_for
    secrets: Secrets  # what redis-py's and the server's words must never show
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    sentinel_kwargs: Mapping[str, Any] = {}
    cluster: tuple[tuple[str, int], ...] = ()  # a Redis Cluster's nodes, to ask first


def parse(uri: LockURI) -> Settings:
    """Translate a lock URI into redis-py settings; raise `ConfigError` for a bad one."""
    try:
        parts = urlsplit(uri.text)
    except ValueError as err:  # e.g. an unclosed [IPv6 bracket
        msg = f"{uri.redacted}: {scrub(str(err), secrets_of(uri.text))}"
        raise ConfigError(msg) from None
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - _OPTIONS[uri.scheme])
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[uri.scheme])) or "none"
        name = option_name(unknown[0], parts.query)
        msg = f"{uri.redacted}: unknown option {name} (allowed: {allowed})"
        raise ConfigError(msg)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    kwargs: dict[str, object] = {
        "username": unquote(username) or query.pop("username", None),
        "password": unquote(password) or query.pop("password", None),
    }
    path = unquote(parts.path)
    if uri.scheme == "unix":
        if not path:
            msg = f"{uri.redacted}: expected unix:///path/to/redis.sock"
            raise ConfigError(msg)
        kwargs["unix_socket_path"] = path
        db = query.pop("db", "0")
    elif uri.scheme == "redis+sentinel":
        service, _, db = path.strip("/").partition("/")
        if not service:
            msg = f"{uri.redacted}: expected redis+sentinel://HOST[:PORT],…/SERVICE[/DB]"
            raise ConfigError(msg)
        sentinels = tuple(host_port(uri, host, SENTINEL_PORT) for host in hosts.split(","))
        if _TLS_OPTIONS & set(query):  # the primary speaks TLS only when the URI says so
            kwargs |= _tls(uri, query)
        kwargs["db"] = _db(uri, _one_db(uri, db, query))
        sentinel = {
            "username": query.pop("sentinel_username", None),
            "password": query.pop("sentinel_password", None),
        }
        return Settings(uri.redacted, kwargs, secrets_of(uri.text), sentinels, service, sentinel)
    elif uri.scheme in CLUSTER_SCHEMES:
        return _cluster(uri, kwargs, hosts, path, query)
    else:
        kwargs["host"], kwargs["port"] = host_port(uri, hosts, DEFAULT_PORT)
        db = _one_db(uri, path.strip("/"), query)
        if uri.scheme == "rediss":
            kwargs |= _tls(uri, query)
    kwargs["db"] = _db(uri, db)
    return Settings(uri.redacted, kwargs, secrets_of(uri.text))


def _cluster(
    uri: LockURI, kwargs: dict[str, object], hosts: str, path: str, query: dict[str, str]
) -> Settings:
    """Return the settings of a redis+cluster:// or rediss+cluster:// URI."""
    if path.strip("/") not in {"", "0"}:
        msg = (
            f"{uri.redacted}: a Redis Cluster has database 0 alone; "
            "expected redis+cluster://HOST[:PORT],…"
        )
        raise ConfigError(msg)
    nodes = tuple(host_port(uri, host, DEFAULT_PORT) for host in hosts.split(","))
    if uri.scheme == "rediss+cluster":
        kwargs |= _tls(uri, query)
    return Settings(uri.redacted, kwargs, secrets_of(uri.text), cluster=nodes)


def _one_db(uri: LockURI, in_path: str, query: dict[str, str]) -> str:
    """Return the database named in the path or in ``?db=``, refusing both at once."""
    if in_path and "db" in query:
        msg = f"{uri.redacted}: the database is given twice, in the path and as ?db="
        raise ConfigError(msg)
    return query.pop("db", in_path or "0")


def _db(uri: LockURI, text: str) -> int:
    if not text.isdigit():
        msg = f"{uri.redacted}: database {text!r} is not a number (redis://HOST/0 … /15)"
        raise ConfigError(msg)
    return int(text)


def _tls(uri: LockURI, query: dict[str, str]) -> dict[str, object]:
    tls: dict[str, object] = {"ssl": True}
    for option in sorted(_TLS_OPTIONS & set(query)):
        tls[option] = value = query.pop(option)
        if option in _TLS_FILES and not readable_file(value):
            msg = f"{uri.redacted}: {option} {value}: no such readable file"
            raise ConfigError(msg)
    if "ssl_check_hostname" in tls:
        tls["ssl_check_hostname"] = tls["ssl_check_hostname"] in {"1", "true", "yes", "on"}
    if tls.get("ssl_cert_reqs", "required") not in {"none", "optional", "required"}:
        msg = f"{uri.redacted}: ssl_cert_reqs must be none, optional or required"
        raise ConfigError(msg)
    return tls


def key_prefix(namespace: str, name: str) -> str:
    """Return the common prefix of a lock's keys: ``lockrun:{NS/NAME}``.

    Bytes that would split the hash tag, the namespace from the name, or a SCAN pattern are
    percent-escaped; everything else (UTF-8 included) stays readable in redis-cli.
    """
    return f"{PREFIX}:{{{_escape(namespace)}/{_escape(name)}}}"


def _escape(text: str) -> str:
    return _KEY_UNSAFE.sub(lambda match: f"%{ord(match[0]):02X}", text)


# What grant() writes in the owners hash: slot, fence (0 for a reader), and when it was
# granted (server ms); then the end of a --hold-at-least window (server ms), or "y:TOKEN"
# for a waiter granted while TOKEN's take-over was pending (it gives way when it claims).
_OWNER: Final = re.compile(
    r"(?P<slot>\d{1,19}) (?P<fence>\d{1,19}) (?P<granted>\d{1,19})"
    r"(?: (?P<window>\d{1,19})| y:\S+)?",
    re.ASCII,
)
SHARED: Final = "s:"  # the start of a reader's token (--shared)
# Next (after any "s:"): a lease kept with no process (acquire --no-keeper). Only such a
# token can be renewed or released by another process (`KeptLease`): a run's or a keeper's
# lease cannot be named by a token of `lockrun release`.
DETACHED: Final = "d:"
_GAVE_WAY: Final = 2  # the acquire script's code for "granted during a take-over: given back"


def _slots(text: str) -> int | None:
    """Return the N stored for a lock, if it is one lockrun could have stored."""
    digits = len(str(MAX_SLOTS))
    if text.isascii() and text.isdigit() and len(text) <= digits and 1 <= int(text) <= MAX_SLOTS:
        return int(text)
    return None


def _well_formed(script: str, reply: Any) -> bool:  # noqa: ANN401 - Lua's reply
    """Return whether *reply* has the shape our *script* returns (see each script above)."""
    if script == "renew":  # 1, 0, or the record of a taker
        return isinstance(reply, int | str)
    if not isinstance(reply, list):
        return False
    if script == "acquire":  # {code, number, number, number, text, token, CLIENT ID, …}
        numbers, text, woken = reply[:4], reply[4:5], reply[5:]
        shaped = len(numbers) == 4 and all(isinstance(number, int) for number in numbers)  # noqa: PLR2004 - four numbers
        shaped = shaped and len(text) == 1 and isinstance(text[0], str)
        return shaped and len(woken) % 2 == 0 and all(isinstance(item, str) for item in woken)
    if script == "status":  # {ms, N, holders, queue, owners, info, waiters}
        head, lists = reply[:2], reply[2:]
        return (
            len(reply) == 7  # noqa: PLR2004 - seven fields
            and isinstance(head[0], int)
            and isinstance(head[1], str)
            and all(isinstance(part, list) for part in lists)
            and all(isinstance(item, str) for part in lists for item in part)
            and all(len(lists[index]) % 2 == 0 for index in (0, 2, 3, 4))
        )
    return len(reply) % 2 == 0 and all(isinstance(item, str) for item in reply)  # woken pairs


def _granted(reply: Any) -> bool:  # noqa: ANN401 - Lua's reply
    """Return whether an acquire or renew *reply* granted or extended a lease.

    A renewal answered with a taker's record extended the lease too.
    """
    return reply == 1 or isinstance(reply, str) or (isinstance(reply, list) and reply[:1] == [1])


def _pairs(flat: list[str]) -> dict[str, str]:
    """Turn a flat Redis reply [k1, v1, k2, v2, …] into a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _keys(prefix: str) -> list[str]:
    return [
        f"{prefix}:{part}"
        for part in (
            "holders",
            "queue",
            "waiters",
            "ticket",
            "fence",
            "owners",
            "info",
            "n",
            "clients",
            "stop",
        )
    ]


# redis-py's error (one of its classes, or words of its message) → what lockrun says; the
# first that matches wins.
_FAILURES: Final[
    tuple[tuple[tuple[type[Exception], ...], tuple[str, ...], type[LockrunError], str], ...]
] = (
    (
        (),
        ("NOAUTH", "HELLO must be called"),
        BackendUnavailable,
        (
            "{where}: the server requires a password; put it in the URI "
            "(or in LOCKRUN_URI, to keep it out of ps)"
        ),
    ),
    (
        (errors.ReadOnlyError,),
        (),
        BackendUnavailable,
        "{where} is a read-only replica; point --uri at the primary (or use redis+sentinel://)",
    ),
    (
        (errors.AuthenticationError,),
        ("WRONGPASS",),
        BackendUnavailable,
        "{where}: authentication failed: {text}",
    ),
    (
        (errors.NoPermissionError,),
        (),
        BackendUnavailable,
        "{where}: the Redis user lacks a permission: {text}",
    ),
    (
        (),
        ("WRONGTYPE",),  # another client wrote a key of the lock as something else
        BackendUnavailable,
        (
            "{where}: a key of this lock holds data lockrun did not write (WRONGTYPE); delete "
            "the lock's keys (docs/backends.md: Redis)"
        ),
    ),
    (
        (),
        ("DB index is out of range",),
        ConfigError,
        "{where}: no such database on this server: {text}",
    ),
    (
        (),
        ("cluster support disabled",),  # CLUSTER MYID, after a grant on a redis+cluster:// URI
        ConfigError,
        "{where}: the server is no node of a Redis Cluster; use redis://HOST[:PORT]",
    ),
    (
        (),
        ("SELECT is not allowed in cluster mode",),
        ConfigError,
        (
            "{where} is a node of a Redis Cluster, which has database 0 alone; "
            "use redis+cluster://HOST[:PORT],…"
        ),
    ),
    (
        (errors.TimeoutError,),
        (),
        BackendUnavailable,
        "{where}: no answer within {timeout:g}s ({text})",
    ),
    ((errors.ConnectionError,), (), BackendUnavailable, "{where}: {text}"),
    (
        (errors.InvalidResponse,),
        ("Protocol error",),
        BackendUnavailable,
        "{where} does not answer like a Redis server ({text})",
    ),
)


# -- the backend -------------------------------------------------------------------------------


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> RedisBackend:
    """Check *uri*; the first call connects, with timeouts that fit leases of *ttl*."""
    return RedisBackend(parse(uri), ttl or DEFAULT_TTL, warn or (lambda _line: None), note)


# What redis-py raises besides its own errors when a "server" answers what Redis never
# would (its parsers and handshake trust the protocol): a reply to report, not a bug (#8).
_REPLY_ERRORS: Final = (
    errors.RedisError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    RecursionError,
)


@contextlib.contextmanager
def _best_effort(*kinds: type[BaseException]) -> Iterator[None]:
    """Give up a best-effort call quietly on *kinds* of failure, never on an interrupt.

    `Interrupted` is a LockrunError too: TERM or INT while waiting must end the wait
    (docs/semantics.md "Signals, the terminal, and time limits").
    """
    try:
        yield
    except Interrupted:
        raise
    except kinds:
        pass


class _SentinelView(NamedTuple):
    """What one sentinel (or a majority of them) says of the service right now."""

    primary: tuple[str, int]
    replicas: int  # those it sees up, linked to their primary or not: any may be promoted
    failing_over: bool

    @classmethod
    def read(cls, address: Any, master: Any, replicas: Any) -> _SentinelView | None:  # noqa: ANN401 - raw replies
        """Build a view from the raw replies of GET-MASTER-ADDR-BY-NAME, MASTER and REPLICAS."""
        if not (isinstance(address, (list, tuple)) and len(address) == 2):  # noqa: PLR2004 - host, port
            return None
        host, port = (_text(part) for part in address)
        if not (port.isascii() and port.isdigit()):
            return None
        up = 0
        for replica in replicas if isinstance(replicas, (list, tuple)) else []:
            flags = set(_field(replica, "flags").split(","))
            up += not flags & {"s_down", "o_down", "disconnected"}
        failing_over = "failover_in_progress" in _field(master, "flags").split(",")
        return cls((host, int(port)), up, failing_over)


def _aim(connection: Any, address: tuple[str, int]) -> None:  # noqa: ANN401 - redis-py's
    """Connect a Sentinel-managed *connection* to *address*, unless it is there and idle.

    Left to itself, redis-py would connect a dropped connection to the primary *it* found,
    not to the one most sentinels name; and a kept connection that the server closed since
    its last use (a restart) would fail the next call.
    """
    if connection.is_connected and (connection.host, int(connection.port or 0)) == address:
        try:
            if not connection.can_read():  # nothing pending, not even the end of the stream
                return
        except (errors.RedisError, OSError):
            pass
    connection.disconnect()
    connection.connect_to(address)


def _text(value: Any) -> str:  # noqa: ANN401 - a raw reply's element
    """Return a raw reply's element as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _field(reply: Any, name: str) -> str:  # noqa: ANN401 - a raw reply
    """Return field *name* of a raw Sentinel reply: a map (RESP3) or a flat list (RESP2)."""
    if isinstance(reply, list):  # pairs, not a dict: a key may be a list or a map
        pairs = list(zip(reply[::2], reply[1::2], strict=False))
    elif isinstance(reply, dict):
        pairs = list(reply.items())
    else:
        return ""
    return _text(next((value for key, value in pairs if _text(key) == name), ""))


class RedisBackend:
    """One connection to a Redis server (or to the primary that Sentinel names)."""

    def __init__(
        self,
        settings: Settings,
        ttl: float,
        warn: Callable[[str], None],
        note: Callable[[str], None] | None = None,
    ) -> None:
        """Remember *settings*; *warn* gets one-line warnings (an eviction policy), *note* -v's."""
        self.settings = settings
        self.warn = warn
        self.note = note or (lambda _line: None)
        self._client: redis.Redis | None = None
        self.ttl = ttl
        self._sentinel: Sentinel | None = None
        self._primary: Any = None  # behind Sentinel: our connection for grants and renewals
        self._primary_lock = threading.Lock()  # the renewal thread and the main one share it
        self._named: tuple[str, int] | None = None  # the primary it was, at the last call
        self._checked = False  # for an eviction policy that could drop our keys
        self._interrupted = False  # set by `interrupt`: every wait ends
        self._sleeping: Any = None  # the connection a waiter sleeps in BLPOP on, if any
        # A Redis Cluster's nodes, by the slots they serve: from a cluster URI, or once a
        # plain one turns out to name a node of a cluster (`_detect_cluster`).
        self._router = Router(settings.cluster, self._node) if settings.cluster else None
        # Whether HELLO said if the server is a cluster's (the URI says so for these)
        self._mode_known = bool(settings.sentinels or settings.cluster)

    @property
    def timeout(self) -> float:
        """How long any one call (connect included) may take."""
        return timeout_for(self.ttl)

    def _options(self) -> dict[str, Any]:
        """Return redis-py's options for every connection: timeouts that fit the ttl.

        Each reply must come whole within the timeout and the size caps of `resp.bound`,
        however the server trickles it.
        """
        return {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "redis_connect_func": bound,
            "decode_responses": True,
            "driver_info": None,  # no CLIENT SETINFO round trips on connect
            # HELLO on connect, whose answer names the connection (_identity) and says
            # whether the server is a node of a cluster (_detect_cluster)
            "protocol": 3,
            # No maintenance notifications: a pushed MOVING would point later connections
            # (and the password) at any address the server names, past the nodes the
            # cluster lists (docs/security.md, "Security model"), and start a timer thread that
            # takes the signals the supervision loop blocks.
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }

    def _node(self, address: tuple[str, int]) -> redis.Redis:
        """Return a client of the cluster node at *address*, logging in as the URI says."""
        kwargs = {
            key: value
            for key, value in self.settings.kwargs.items()
            if key not in {"host", "port", "db"}
        }
        host, port = address
        return redis.Redis(
            host=host, port=port, **kwargs, **self._options(), retry=Retry(NoBackoff(), 0)
        )

    def client(self) -> redis.Redis:
        """Return the client, made on first use, with timeouts that fit the backend's ttl.

        On a cluster: the client of the first node the URI names (CONFIG GET, CLIENT LIST
        and the like go to the lock's node: `node_client`).
        """
        if self._router is not None:
            return self._router.client(self._router.known[0])
        if self._client is None:
            options = self._options()
            # No hidden retries: a retried BLPOP could outlive the lease (docs/design.md P8);
            # lockrun's own loops decide when to ask again.
            no_retries = Retry(NoBackoff(), 0)
            settings = self.settings
            if settings.sentinels:
                sentinel_options = {
                    key: value for key, value in settings.sentinel_kwargs.items() if value
                }
                sentinel = Sentinel(  # type: ignore[no-untyped-call]
                    settings.sentinels,
                    sentinel_kwargs=options | sentinel_options | {"retry": no_retries},
                    **options,
                )
                self._client = sentinel.master_for(  # type: ignore[no-untyped-call]
                    settings.service, **settings.kwargs, **options, retry=no_retries
                )
                self._sentinel = sentinel
            else:
                self._client = redis.Redis(**settings.kwargs, **options, retry=no_retries)
        return self._client

    def node_client(self, prefix: str) -> redis.Redis:
        """Return the client of the node that holds the lock of *prefix* (on a cluster)."""
        if self._router is not None:
            return self._router.client(self._router.node(slot_of(prefix)))
        return self.client()

    def call(
        self, script: str, claim: Claim, *args: str | int, identify: bool | None = None
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run one of our scripts for *claim*; translate redis-py's errors.

        With *identify* given, one more argument follows *args*: if true, the CLIENT ID of
        the connection that carries the call (`_identity`), else "".

        Behind Sentinel, every write goes to the primary the sentinels name, and a grant
        or a renewal counts only once a replica has it (`_on_the_primary`). A release
        sent to a demoted primary would leave the lease to run out on the new one. On a
        cluster, every call goes to the node that serves the lock's slot, and a grant or
        a renewal counts only once a replica has it too (`_on_the_node`).
        """
        keys = _keys(claim.prefix)
        argv = [claim.prefix, claim.token, claim.slots, claim.ttl_ms, *args]
        durable = script in {"acquire", "renew"}
        try:
            if self._sentinel is not None and script != "status":
                reply = self._on_the_primary(script, keys, argv, durable=durable, identify=identify)
            else:
                reply = None
                if self._router is None:
                    try:
                        reply = self._on_a_pooled_connection(script, keys, argv, identify=identify)
                    except errors.MovedError as moved:  # a node of a cluster that HELLO hid
                        if not self._detect_cluster(None, moved):
                            raise
                if self._router is not None:
                    reply = self._on_the_node(
                        script, keys, argv, durable=durable, identify=identify
                    )
        except _REPLY_ERRORS as err:
            raise self.failure(err) from err
        if not _well_formed(script, reply):  # not our script's answer: not Redis, or tampered
            msg = f"{self.settings.where}: the server's reply is not Redis's (to {script})"
            raise BackendUnavailable(msg)
        return reply

    def _on_a_pooled_connection(
        self, script: str, keys: list[str], argv: list[Any], *, identify: bool | None
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run *script* on a connection of redis-py's pool (which reconnects a closed one)."""
        pool = self.client().connection_pool
        connection = pool.get_connection()
        try:
            if self._detect_cluster(connection):
                return None  # the caller asks again, the cluster's way
            if identify is not None:
                argv = [*argv, self._identity(connection) if identify else ""]
            return _run(connection, script, keys, argv)[0]
        except BaseException:  # a reply may still be on its way: never reuse the connection
            connection.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(connection)

    def _detect_cluster(self, connection: Any, moved: Exception | None = None) -> bool:  # noqa: ANN401 - redis-py's Connection
        """Switch to the cluster's ways if a plain URI's server is a node of a Redis Cluster.

        Return whether it switched.

        Its answer to HELLO, on every connect, says so (no round trip of its own); a
        MOVED, where something hid it. A cluster has database 0 alone, and redirects
        name TCP addresses: a unix: URI, or another database, is refused (78).
        """
        if self._router is not None or (moved is None and self._mode_known):
            return False
        if moved is None:
            said = getattr(connection, "handshake_metadata", None)
            mode = said.get("mode", said.get(b"mode")) if isinstance(said, dict) else None
            self._mode_known = True  # asked once: the HELLO of later connections agrees
            if mode not in {"cluster", b"cluster"}:
                return False
        where, kwargs = self.settings.where, self.settings.kwargs
        if "unix_socket_path" in kwargs or kwargs.get("db"):
            what = "a unix socket" if "unix_socket_path" in kwargs else f"database {kwargs['db']}"
            msg = (
                f"{where} is a node of a Redis Cluster, which lockrun cannot reach through "
                f"{what}; use redis+cluster://HOST[:PORT],… (database 0)"
            )
            raise ConfigError(msg)
        host, port = address = (str(kwargs["host"]), int(kwargs["port"]))
        self._router = Router([address], self._node)
        scheme = "rediss+cluster" if kwargs.get("ssl") else "redis+cluster"
        shown = f"[{host}]" if ":" in host else host
        self.note(f"{where} is a node of a Redis Cluster: using it as {scheme}://{shown}:{port}")
        return True

    def _on_the_node(
        self, script: str, keys: list[str], argv: list[Any], *, durable: bool, identify: bool | None
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run *script* on the cluster node that serves the lock's slot (`Router.run`).

        A grant or a renewal counts only once a replica has it (`check_durable`): a
        cluster promotes a replica when its primary fails, and replication is
        asynchronous.
        """
        assert self._router is not None  # noqa: S101 - only on a cluster
        checks = (("ROLE",), ("CLUSTER", "MYID")) if durable else ()
        wait_ms = max(1, int(self.timeout * 500))

        def attempt(connection: Any, asking: bool) -> Any:  # noqa: ANN401 - a reply
            said = argv
            if identify is not None:
                said = [*argv, self._identity(connection) if identify else ""]
            replies = _run(connection, script, keys, said, *checks, asking=asking)
            if durable and _granted(replies[0]):
                role, myself = replies[1:]
                check_durable(
                    connection, f"{connection.host}:{connection.port}", role, myself, wait_ms
                )
            return replies[0]

        return self._router.run(slot_of(argv[0]), attempt, budget=self.timeout * 2)

    @staticmethod
    def _identity(connection: Any) -> str:  # noqa: ANN401 - redis-py's Connection
        """Return *connection*'s CLIENT ID, by which a releaser sees that we still wait.

        The server says it in its answer to HELLO, which redis-py sends on every connect:
        no round trip, and a reconnect (ours, or redis-py's after a restart) never leaves
        us naming a connection that is gone. "" where it is not said: our place in the
        queue then lapses a ttl after our death.
        """
        connection.connect()  # no-op if connected
        said = connection.handshake_metadata
        number = said.get("id", said.get(b"id")) if isinstance(said, dict) else None
        return str(number) if type(number) is int and number > 0 else ""

    def _on_the_primary(
        self, script: str, keys: list[str], argv: list[Any], *, durable: bool, identify: bool | None
    ) -> Any:  # noqa: ANN401 - Lua's reply
        """Run *script* where the sentinels say the primary is; make what it grants *durable*.

        A demoted primary stays writable for seconds after a failover, and one cut off
        with its clients stays writable for as long as the cut lasts: a lease renewed
        there is worth nothing (docs/design.md A5). So the node must be the one
        that most of the sentinels name now, it must call itself a primary, and a grant or
        renewal counts only once a connected replica has it (WAIT), so that promoting that
        replica cannot forget it (`_check_durable`).
        """
        view = self._sentinel_view()
        self._named = view.primary
        with self._primary_lock:
            if self._primary is None:  # ours alone: the pool would drop one it did not pick
                self._primary = self.client().connection_pool.make_connection()
            connection = self._primary
            try:
                _aim(connection, view.primary)
                if identify is not None:
                    argv = [*argv, self._identity(connection) if identify else ""]
                reply, role = _run(connection, script, keys, argv, ("ROLE",))
                self._check_durable(connection, view, role, written=durable and _granted(reply))
            except BaseException:
                connection.disconnect()  # a reply may still be on its way: never reuse it
                raise
            return reply

    def _check_durable(
        self,
        connection: Any,  # noqa: ANN401 - redis-py's Connection
        view: _SentinelView,
        role: Any,  # noqa: ANN401 - ROLE's reply, or the error it got
        *,
        written: bool,
    ) -> None:
        """Raise unless the node is a primary and, if we *written*, a failover keeps it.

        A primary without a connected replica is trusted alone only when the sentinels
        see no replica up either: then none can be promoted over it. One that is up but
        does not replicate from this node (yet, or any more) may be promoted without what
        we wrote, or may have been a moment ago: the sentinels name a new primary only
        about a second after they promote it.
        """
        where = f"{view.primary[0]}:{view.primary[1]}"
        if isinstance(role, Exception):  # ROLE refused (an ACL): say so
            raise role
        if not role or role[0] != "master":
            msg = f"{where} is not a primary (it says {role[:1]})"
            raise NotDurable(msg)
        if not written:
            return
        if view.failing_over:
            msg = f"a failover of {self.settings.service!r} is under way"
            raise NotDurable(msg)
        if role[2]:  # it has replicas: wait until one has what we wrote
            wait_ms = max(1, int(self.timeout * 500))
            connection.send_command("WAIT", 1, wait_ms)
            if connection.read_response() == 0:
                msg = (
                    f"no replica of {where} acknowledged the lease within {wait_ms}ms; "
                    "a failover now could forget it"
                )
                raise NotDurable(msg)
        elif view.replicas:
            msg = (
                f"{where} has no replica in sync, but the sentinels see {view.replicas} up; "
                "a failover could promote one without the lease"
            )
            raise NotDurable(msg)

    def _sentinel_view(self) -> _SentinelView:
        """Return the primary that most of the URI's sentinels name now, and what they know.

        Not redis-py's discovery, which takes the first sentinel that answers, and its
        master list, which names the new primary only once a failover has ended.
        """
        assert self._sentinel is not None  # noqa: S101 - only behind Sentinel
        sentinels = self._sentinel.sentinels
        service = self.settings.service
        views: list[_SentinelView] = []
        for sentinel in sentinels:
            try:
                with sentinel.pipeline(transaction=False) as pipe:
                    pipe.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", service)  # type: ignore[no-untyped-call]
                    pipe.execute_command("SENTINEL", "MASTER", service)  # type: ignore[no-untyped-call]
                    pipe.execute_command("SENTINEL", "REPLICAS", service)  # type: ignore[no-untyped-call]
                    address, master, replicas = pipe.execute()
            except _REPLY_ERRORS:
                continue  # unreachable, it does not know the service, or not a sentinel
            if view := _SentinelView.read(address, master, replicas):
                views.append(view)
        for view in views:
            agreeing = [other for other in views if other.primary == view.primary]
            if len(agreeing) * 2 > len(sentinels):
                return _SentinelView(
                    view.primary,
                    replicas=max(other.replicas for other in agreeing),
                    failing_over=any(other.failing_over for other in views),
                )
        raise MasterNotFoundError(f"no majority of the sentinels names a primary for {service!r}")

    def failure(self, err: Exception) -> LockrunError:
        """Translate a redis-py error into one line, naming the server but no password."""
        where = self.settings.where
        if not isinstance(err, errors.RedisError):  # one of _REPLY_ERRORS: not Redis talking
            return BackendUnavailable(
                f"{where}: the server's reply is not Redis's ({type(err).__name__})"
            )
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        text = scrub(text, self.settings.secrets)
        if isinstance(err, MasterNotFoundError):
            sentinels = ",".join(f"{host}:{port}" for host, port in self.settings.sentinels)
            return BackendUnavailable(
                f"{where}: no majority of the sentinels at {sentinels} named a reachable "
                f"primary for {self.settings.service!r}"
            )
        for kinds, words, error, what in _FAILURES:
            if isinstance(err, kinds) or any(word in text for word in words):
                return error(what.format(where=where, text=text, timeout=self.timeout))
        return BackendUnavailable(f"{where}: {text}")

    def check_eviction(self, client: redis.Redis) -> None:
        """Warn once when the server may evict lock keys under memory pressure.

        docs/design.md P25.
        """
        try:
            config = client.config_get("maxmemory*")
        except errors.ResponseError:  # managed Redis often forbids CONFIG: nothing to say
            return
        except _REPLY_ERRORS as err:
            raise self.failure(err) from err
        policy = config.get("maxmemory-policy", "noeviction")
        if config.get("maxmemory", "0") != "0" and policy != "noeviction":
            self.warn(
                f"warning: {self.settings.where} has maxmemory-policy {policy}: under memory "
                "pressure it may evict lock keys and let a second holder in; use noeviction"
            )

    def acquire(self, request: Request, deadline: float | None) -> RedisLease | None:
        """Queue for a slot and sleep in BLPOP until one is ours, or *deadline* passes."""
        claim = Claim.of(request)
        record = json.dumps(request.holder.to_dict())
        mode = "take" if request.take_over else "wait"
        if deadline is not None and deadline <= now():
            mode = "try"
        heard: float | None = None  # when the server last answered; None: not yet
        try:
            while True:
                try:
                    self.prepare(self.node_client(claim.prefix))
                    sent = now()  # the lease runs from here (ZADD now + ttl on the server)
                    # A waiter names its connection, for releasers to see whether it lives.
                    granted, number, extra, taken, text, *woken = self.call(
                        "acquire", claim, record, mode, identify=mode != "try"
                    )
                    heard = now()
                    # granted: number is our slot, extra our fence (0: a reader's, none),
                    # and our lease runs (no calls for the sake of others now: the woken
                    # lapse as before)
                    if granted == 1:
                        fence = None if request.shared else extra
                        return RedisLease(self, claim, slot=number, fence=fence, sent=sent)
                    if granted == -1:  # number: the N the live users of the name have
                        raise self.mismatch(request, claim.prefix, number)
                    self.pass_over_the_dead(claim, woken)
                    if granted == _GAVE_WAY:  # text: the taker's record; nothing is held
                        raise TakenOver(_taken_over_by(text))
                    # number: our place in the queue; extra: ms until a lease, or a place
                    # ahead of ours, may lapse; taken: ms the lock stays taken for sure (a
                    # --hold-at-least window)
                    if mode == "try" or not self.wait_in_line(claim, deadline, extra, taken):
                        return None  # nothing was queued, or we left the queue
                except BackendUnavailable as err:
                    self._check_interrupted(request)
                    heard = self.ride_out(err, heard, request.ttl, deadline, mode)
                self._check_interrupted(request)
        except TakenOver:
            raise  # the script gave the slot back and left the queue
        except BaseException:
            # Our place in the queue, or a slot granted meanwhile: `leave` has every reply
            # within one timeout in all, so that TERM ends lockrun soon however the server
            # trickles (docs/semantics.md "Signals, the terminal, and time limits").
            self.leave(claim)
            raise

    def wait_in_line(self, claim: Claim, deadline: float | None, extra: int, taken: int) -> bool:
        """Sleep until our wake list is pushed or *extra* ms pass; False if we gave up instead.

        We give up (and leave the queue) once *deadline* has passed, or at once when the
        lock stays taken for *taken* more ms, beyond it (a --hold-at-least window).
        """
        remaining = None if deadline is None else deadline - now()
        if remaining is not None and (remaining <= 0 or remaining < taken / 1000):
            self.leave(claim)  # busy at once, not after the wait
            return False
        # Bounded sleeps: the wake list is only a hint (docs/design.md D2), and asking
        # again renews our place in the queue, which lapses after a ttl without word.
        block = min(extra / 1000 + 0.002, claim.ttl_ms / 2000)
        if remaining is not None:
            block = min(block, remaining)
        self.sleep(f"{claim.prefix}:wake:{claim.token}", block)
        return True

    def interrupt(self) -> None:
        """From another thread: end a waiting `acquire` at once; it raises `Interrupted`.

        Its BLPOP's connection is cut; `acquire` then leaves the queue.
        """
        self._interrupted = True
        connection = self._sleeping
        sock = getattr(connection, "_sock", None)  # redis-py's socket, if connected
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _check_interrupted(self, request: Request) -> None:
        if self._interrupted:
            msg = f"the wait for {request.name} was interrupted; nothing is held"
            raise Interrupted(msg, signo=signal.SIGINT)

    def prepare(self, client: redis.Redis) -> None:
        """Before asking: warn of eviction, once per backend."""
        if not self._checked:
            self.check_eviction(client)
            self._checked = True

    def ride_out(
        self,
        err: BackendUnavailable,
        heard: float | None,
        ttl: float,
        deadline: float | None,
        mode: str,
    ) -> float | None:
        """Pause before asking again after a lost connection while queued; else raise *err*.

        A waiter already in the queue rides out a restart, a failover or a blip for up to a
        ttl (its place may lapse meanwhile; it then queues again). Failing to get in at
        all, or a refusal such as a wrong password, is reported at once (69). A primary
        that answers but cannot make a grant durable yet is no outage: a waiter waits on,
        within --wait; so is a primary that does not answer while a majority of the
        sentinels still do: they are about to promote another. Return when the server (or
        the sentinels) last answered.
        """
        cause = err.__cause__
        transient = isinstance(cause, errors.ConnectionError | errors.TimeoutError) and not (
            isinstance(cause, errors.AuthenticationError | errors.AuthorizationError)
        )
        current = now()
        if mode != "try" and transient and self._sentinels_answer(cause):
            heard = current
        if not transient or heard is None or current - heard > ttl:
            raise err
        if deadline is not None and current >= deadline:
            raise err
        time.sleep(min(RECONNECT_INTERVAL, ttl / 10))
        return heard

    def _sentinels_answer(self, cause: BaseException | None) -> bool:
        """Return whether *cause* came behind Sentinel while a majority of them answer."""
        if isinstance(cause, NotDurable | Unsettled):
            return True
        if self._sentinel is None:
            return False
        try:
            self._sentinel_view()
        except _REPLY_ERRORS:
            return False
        return True

    def sleep(self, key: str, seconds: float) -> None:
        """BLPOP *key* for up to *seconds*, on a read timeout just longer than the block.

        On a cluster, a redirect ends the sleep (the wake list is only a hint): the
        waiter asks again, where the slot is now.
        """
        try:
            pool = self.node_client(key).connection_pool
            connection = pool.get_connection()  # may connect again, and fail
        except _REPLY_ERRORS as err:
            raise self.failure(err) from err
        self._sleeping = connection
        try:
            if self._interrupted:  # before we slept: `interrupt` had nothing to cut
                return
            if self._named is not None:  # behind Sentinel: the wake-up is pushed there
                _aim(connection, self._named)
            connection.send_command("BLPOP", key, f"{max(seconds, 0.01):.3f}")  # type: ignore[no-untyped-call]
            connection.read_response(timeout=seconds + self.timeout)
        except errors.ResponseError as err:
            if not self._cluster_news(err, key, connection, seconds):
                raise self.failure(err) from err
        except _REPLY_ERRORS as err:
            connection.disconnect()  # type: ignore[no-untyped-call]
            raise self.failure(err) from err
        except BaseException:
            connection.disconnect()  # type: ignore[no-untyped-call]  # a reply may be on its way: never reuse this connection
            raise
        finally:
            self._sleeping = None
            pool.release(connection)

    def _cluster_news(
        self,
        err: Exception,
        key: str,
        connection: Any,  # noqa: ANN401 - redis-py's Connection
        seconds: float,
    ) -> bool:
        """Return whether a BLPOP's error *err* is a cluster's news, to ask again after.

        MOVED, ASK, TRYAGAIN (a migration), UNBLOCKED (a failover made the primary a
        replica): the wake list is only a hint, and the next ask goes where the slot is
        served now. CLUSTERDOWN raises: an outage that a waiter rides out.
        """
        if self._router is None:
            return False
        if isinstance(err, errors.ClusterDownError):
            unsettled = Unsettled(f"the cluster cannot serve this lock now: {err}")
            raise self.failure(unsettled) from err
        if isinstance(err, errors.MovedError):
            address = (err.host or connection.host, int(err.port))
            try:
                self._router.moved(slot_of(key), address, connection)
            except _REPLY_ERRORS as refused:
                raise self.failure(refused) from refused
        elif isinstance(err, errors.AskError | errors.TryAgainError):
            time.sleep(min(seconds, 0.1))  # mid-migration: not in a tight loop
        return isinstance(err, errors.AskError | errors.TryAgainError) or str(err).startswith(
            "UNBLOCKED"
        )

    def leave(self, claim: Claim, hold_ms: int = 0, *, own: Any = None) -> bool:  # noqa: ANN401 - redis-py's Connection
        """Give up a slot or a place in the queue; best effort, as both lapse by themselves.

        *hold_ms*: keep a held slot taken that long (--hold-at-least). *own*: a lease's own
        connection (`track`), used for the release if it can be, then given to the pool.
        Return whether the server answered the release. All its replies (again on the
        pool, passing over the dead) come within one call's timeout in all: a slow or
        hostile server cannot hold a finished run, deaf to TERM, for a timeout per call
        (docs/semantics.md "What bounds a call").
        """
        woken: list[str] | None = None
        with within(self.timeout):
            if own is not None:
                woken = self._release_on(own, claim, hold_ms)
            with _best_effort(LockrunError):
                if woken is None:  # D3: a release is idempotent, asked again if in doubt
                    woken = self.call("release", claim, hold_ms)
                self.pass_over_the_dead(claim, woken)
        return woken is not None

    def abandon(self, orphan: bytes) -> None:
        """Free the lease of a lockrun that died (`RedisLease.orphan`), in its guardian.

        Without this a killed holder's slot stayed taken for the rest of its ttl (G5).
        """
        prefix, token, slots, ttl_ms = json.loads(orphan)
        self.leave(Claim(prefix, token, slots, ttl_ms))

    def track(self, claim: Claim) -> tuple[Any, bool]:
        """Take a connection out of the pool on which Redis pushes writes to *claim*'s stop key.

        Client-side caching's tracking (RESP3), OPTIN: only the key read right after
        CLIENT CACHING yes is tracked, once; each renewal on the connection reads it again.
        Return the connection (None behind Sentinel, on a cluster, or when the server
        refuses: the renewals' cadence remains) and whether the key holds something already.
        """
        if self._sentinel is not None or self._router is not None or not self._mode_known:
            return None, False
        try:
            pool = self.client().connection_pool
            connection: Any = pool.get_connection()
        except _REPLY_ERRORS:
            return None, False
        replies: list[Any] = []
        try:
            replies = _pipeline(connection, *_TRACK, ("GET", f"{claim.prefix}:stop"))
        except BaseException as err:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            if not isinstance(err, _REPLY_ERRORS):
                pool.release(connection)
                raise
        if not replies or any(isinstance(reply, Exception) for reply in replies):
            pool.release(connection)
            return None, False
        return connection, replies[-1] is not None

    def renew_on(self, connection: Any, claim: Claim, *, track: bool) -> tuple[Any, bool]:  # noqa: ANN401 - redis-py's Connection
        """Run the renew script on a lease's own *connection*, tracking the stop key again.

        Return its reply and whether the server still tracks the key for us. A connection
        lost meanwhile is made again by redis-py (without our bell: renewals remain).
        """
        keys = _keys(claim.prefix)
        argv = [claim.prefix, claim.token, claim.slots, claim.ttl_ms]
        after = (*_TRACK, ("GET", f"{claim.prefix}:stop")) if track else ()
        try:
            reply, *tracked = _run(connection, "renew", keys, argv, *after)
        except _REPLY_ERRORS as err:
            connection.disconnect()
            raise self.failure(err) from err
        except BaseException:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            raise
        if not _well_formed("renew", reply):
            msg = f"{self.settings.where}: the server's reply is not Redis's (to renew)"
            raise BackendUnavailable(msg)
        return reply, track and not any(isinstance(each, Exception) for each in tracked)

    def _release_on(self, connection: Any, claim: Claim, hold_ms: int) -> list[str] | None:  # noqa: ANN401 - redis-py's Connection
        """Release on a lease's own *connection* and end its tracking; give it to the pool.

        Return the woken pairs, or None if the call failed (the caller asks again).
        """
        keys = _keys(claim.prefix)
        argv = [claim.prefix, claim.token, claim.slots, claim.ttl_ms, hold_ms, 1]
        pool = self.client().connection_pool
        woken: list[str] | None = None
        try:
            reply, _ = _run(connection, "release", keys, argv, ("CLIENT", "TRACKING", "OFF"))
            if _well_formed("release", reply):
                woken = reply
        except _REPLY_ERRORS:
            connection.disconnect()  # a reply may still be on its way: never reuse it
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
        return woken

    def pass_over_the_dead(self, claim: Claim, woken: list[str]) -> None:
        """Take back the slots just granted to waiters whose connection is gone.

        A waiter killed in the queue would otherwise keep the slot it is granted until its
        place lapses, up to its ttl, while the living wait behind it. The server drops a
        dead process's connection at once; a waiter that lost its connection but lives
        asks again from a new one before it claims the slot, and then only queues again.
        Best effort: where CLIENT LIST is not allowed, or a call fails, the ttl still frees
        the slot.
        """
        if not woken:  # the common case: nobody was woken
            return
        with _best_effort(LockrunError, *_REPLY_ERRORS):
            for _ in range(_DROP_ROUNDS):
                pairs = dict(zip(woken[::2], woken[1::2], strict=True))
                ids: list[EncodableT] = [client for client in pairs.values() if client]
                if not ids:
                    return
                listed = self.node_client(claim.prefix).client_list(client_id=ids)
                alive = {str(entry["id"]) for entry in listed}
                gone = [
                    item
                    for token, client in pairs.items()
                    if client and client not in alive
                    for item in (token, client)
                ]
                if not gone:
                    return
                woken = self.call("drop", claim, *gone)

    def mismatch(self, request: Request, prefix: str, slots: int) -> ConfigError:
        """Return the --slots mismatch error, naming a live user of the other N."""
        users = self.status(request.namespace, request.name)
        people = [person for state in users for person in (*state.holders, *state.waiters)]
        return slots_mismatch(request, slots, people[0] if people else None, prefix)

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """Report holders and waiters of *name*, or of every lock in *namespace*."""
        if name is not None:
            prefixes = [key_prefix(namespace, name)]
        else:
            pattern = f"{PREFIX}:{{{_escape(namespace)}/*}}:info"
            try:
                found = {
                    key.removesuffix(":info")
                    for client in self._every_primary()
                    for key in client.scan_iter(match=pattern, count=1000)
                }
            except _REPLY_ERRORS as err:
                raise self.failure(err) from err
            prefixes = sorted(found)
        states = []
        for prefix in prefixes:
            state = self.state(namespace, name, prefix)
            if state is not None:
                states.append(state)
        return states

    def _every_primary(self) -> list[redis.Redis]:
        """Return a client of the server, or of every primary of a cluster (for SCAN)."""
        if self._router is None and not self._mode_known:
            pool = self.client().connection_pool
            connection = pool.get_connection()  # its HELLO says whether it is a cluster's
            try:
                self._detect_cluster(connection)
            finally:
                pool.release(connection)
        if self._router is None:
            return [self.client()]
        return [self._router.client(address) for address in self._router.primaries()]

    def state(self, namespace: str, name: str | None, prefix: str) -> LockState | None:
        """Read one lock's keys in one consistent snapshot; None if nobody holds or waits.

        A *name* asked for by the user is reported even when free.
        """
        reply = self.call("status", Claim(prefix, "", 1, 1))
        server_ms, slots = int(reply[0]), _slots(str(reply[1]))
        holders, queue, owners, info, waiters = (
            _pairs(reply[2]),
            list(reply[3]),
            _pairs(reply[4]),
            _pairs(reply[5]),
            _pairs(reply[6]),
        )

        def person(token: str, expires_ms: str | None) -> Holder:
            # Any client of this server may have written these: a bad record shows as "?".
            try:
                holder = Holder.from_dict(read_json(info.get(token, "")))
            except ValueError:
                holder = Holder("?", 0, "?", ())
            # The token says the mode, the owners entry a window; never the record's word.
            holder = holder._replace(shared=token.startswith(SHARED), until=None, detached=False)
            owner = _OWNER.fullmatch(owners.get(token, ""))
            if expires_ms is None or owner is None:
                return holder
            slot = int(owner["slot"])
            expires = float(expires_ms) / 1000
            # A window's end is the lease's (what the scripts go by), shown no later than
            # the longest window from now: another client may have written +inf.
            window = min(expires, server_ms / 1000 + MAX_WAIT) if owner["window"] else None
            return holder._replace(
                slot=slot if slot < MAX_SLOTS else None,
                since=int(owner["granted"]) / 1000,
                expires=expires,
                until=window,
                detached=window is None and token.removeprefix(SHARED).startswith(DETACHED),
            )

        held = tuple(
            person(token, expiry) for token, expiry in holders.items() if float(expiry) > server_ms
        )
        waiting = tuple(
            person(token, None)
            for token in queue
            if token in waiters and float(waiters[token]) > server_ms
        )
        if name is None:
            if not held and not waiting:
                return None
            name = unquote(prefix.partition("/")[2].removesuffix("}"))
        return LockState(namespace, name, prefix, slots, held, waiting)

    @property
    def where(self) -> str:
        """The URI, with no password: for messages."""
        return self.settings.where

    def place(self) -> str:
        """Name the server (or Sentinel service) and database we reach, with no credentials.

        Alike for every spelling of one URI: the default port and database written or not,
        the host in any case, the sentinels in any order (`lockrun.detached`'s tokens).
        """
        kwargs, db = self.settings.kwargs, self.settings.kwargs.get("db", 0)
        if self.settings.sentinels:
            hosts = ",".join(
                sorted(f"{host.lower()}:{port}" for host, port in self.settings.sentinels)
            )
            return f"sentinel {hosts}/{self.settings.service}/{db}"
        if "unix_socket_path" in kwargs:
            return f"unix {os.path.normpath(kwargs['unix_socket_path'])}/{db}"
        if "host" not in kwargs:  # pragma: no cover - a form this code does not know yet
            return f"uri {self.settings.where}"  # as written, without its password
        return f"tcp {str(kwargs['host']).lower()}:{kwargs['port']}/{db}"

    def kept(self, request: Request, hold: float) -> KeptLease:
        """Return the lease that *request*'s ``lease_id`` names, kept with no process.

        *request* is the one `acquire` was given, as its token tells it (no holder); *hold*
        its --hold-at-least.
        """
        return KeptLease(self, Claim.of(request), math.ceil(hold * 1000))

    def close(self) -> None:
        """Drop the connections."""
        if self._primary is not None:
            self._primary.disconnect()
            self._primary = None
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()
            self._client = None
        if self._router is not None:
            self._router.close()


class Claim(NamedTuple):
    """One acquisition: the lock's key prefix, our random token, N, and the lease in ms."""

    prefix: str
    token: str
    slots: int
    ttl_ms: int

    @classmethod
    def of(cls, request: Request) -> Claim:
        """Return a new acquisition for *request*; a reader's token says so ("s:").

        So does a lease kept with no process ("d:"), whose id the caller chose.
        """
        token = f"{DETACHED}{request.lease_id}" if request.lease_id else secrets.token_hex(10)
        return cls(
            key_prefix(request.namespace, request.name),
            f"{SHARED}{token}" if request.shared else token,
            request.slots,
            max(1, round(request.ttl * 1000)),
        )


class RedisLease:
    """A slot held in Redis until its lease, renewed every ttl/3 by the supervisor, ends.

    Asked for its `bells`, it takes a connection of its own out of the pool and has Redis
    track the lock's stop key on it (`RedisBackend.track`): a take-over request then makes
    Redis push a message on that connection. A thread of the lease's reads what arrives
    between two calls of ours and rings the bell (an eventfd); the socket itself cannot be
    the bell, since the answer to every renewal would ring it. The renewals run on that
    connection and track the key again, in their one round trip.
    """

    fds: tuple[int, ...] = ()
    sessions: tuple[int, ...] = ()  # the lease outlives a connection

    def __init__(
        self, backend: RedisBackend, claim: Claim, *, slot: int, fence: int | None, sent: float
    ) -> None:
        """Describe the slot *claim* holds, granted by a call *sent* then."""
        self.backend = backend
        self.claim = claim
        self.slot = slot
        self.fence = fence
        self.confirmed = sent
        self.ttl: float | None = claim.ttl_ms / 1000
        self.released = False
        self._using = threading.Lock()  # the renewals, `Lock.check` and the bell share _own
        self._own: Any = None  # our connection, tracking the stop key, once bells were asked
        # Until the server refuses CLIENT TRACKING (an ACL, Redis < 6). Only a lone holder
        # has a bell: the release's write that ends the tracking would ring every other
        # reader or slot holder (a renewal each, per release), and their entries in Redis's
        # tracking table would pile up for as long as the lock is never left alone.
        self._tracking = claim.slots == 1 and not claim.token.startswith(SHARED)
        self._bell: int | None = None  # an eventfd: readable when Redis pushed something
        self._quit: int | None = None  # an eventfd that ends the listening thread
        self._listener: threading.Thread | None = None

    @property
    def bells(self) -> tuple[int, ...]:
        """An eventfd that turns readable when Redis pushes a write to the lock's stop key.

        The first call takes the connection and arms it (one round trip). None for a
        reader or a slot of N > 1, behind Sentinel, whose primary connection is shared and
        re-aimed, on a cluster, whose slot may move to another node, nor where the server
        refuses tracking: renewals every ttl/3 still see a take-over.
        """
        with self._using:
            if self._bell is None and self._tracking and not self.released:
                self._own, asked = self.backend.track(self.claim)
                self._tracking = self._own is not None
                if self._tracking:
                    # rung already if a take-over may have been asked before we listened
                    self._bell = os.eventfd(int(asked), os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    self._quit = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    self._listen()
            return () if self._bell is None else (self._bell,)

    def _listen(self) -> None:
        """Start the thread that rings the bell, with every signal blocked.

        The supervisor waits for its signals with them blocked (sigtimedwait): a thread
        that left one unblocked could be handed it, or killed by it.
        """
        thread = threading.Thread(target=self._ring, name="lockrun-redis-bell", daemon=True)
        saved = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, saved)
        self._listener = thread

    def _ring(self) -> None:
        """Ring the bell for each message Redis pushes while none of our calls is under way.

        Ends when the lease is released or the connection lost (the next renewal makes a
        new one and listens again).
        """
        poll = select.poll()
        assert self._quit is not None  # noqa: S101 - set before the thread starts
        poll.register(self._quit, select.POLLIN)
        watched = -1
        while True:
            with self._using:  # a call of ours under way reads its own answer first
                own = self._own
                sock = getattr(own, "_sock", None)
                if own is None or sock is None or self._bell is None:
                    return
                try:
                    pushed = own.can_read(timeout=0)
                    if pushed:
                        own.read_response(push_request=True)
                except _REPLY_ERRORS:
                    own.disconnect()  # a renewal finds out what happened, on a new one
                    pushed = True
                if pushed:
                    os.eventfd_write(self._bell, 1)
                    continue
                if sock.fileno() != watched:
                    if watched >= 0:
                        poll.unregister(watched)
                    watched = sock.fileno()
                    poll.register(watched, select.POLLIN)
            if any(fd == self._quit for fd, _ in poll.poll()):
                return

    def refresh(self) -> None:
        """Extend the lease by a ttl; `LeaseLost` if it ended or Redis lost it.

        `TakenOver` (with the lease extended) while another acquirer asks for a take-over.
        """
        with self._using:
            if self._own is None:
                reply = self.backend.call("renew", self.claim)
            else:
                if self._bell is not None:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._bell)  # heard: this renewal answers it
                reply, self._tracking = self.backend.renew_on(
                    self._own, self.claim, track=self._tracking
                )
                if self._tracking and not (self._listener and self._listener.is_alive()):
                    self._listen()  # the connection was made again
        if isinstance(reply, str):  # the taker's record
            raise TakenOver(_taken_over_by(reply))
        if reply != 1:
            msg = (
                "the Redis lease is gone (expired, evicted, FLUSHALL, or a restart or failover "
                "that lost it)"
            )
            raise LeaseLost(msg)

    @property
    def orphan(self) -> bytes:
        """What the guardian needs to free this lease should lockrun die (`abandon`)."""
        return json.dumps(list(self.claim)).encode()

    def release(self, hold: float = 0.0) -> bool:
        """Give the slot back and wake the next waiter; silent if the lease was lost.

        With *hold*, keep it taken until the server's clock is *hold* seconds on
        (--hold-at-least): nothing of ours keeps running for that. Return whether the
        server answered.
        """
        with self._using:
            if self.released:
                return True
            self.released = True
            own, self._own = self._own, None
            if self._quit is not None:
                os.eventfd_write(self._quit, 1)
        if self._listener is not None:
            self._listener.join()
        for fd in (self._bell, self._quit):
            if fd is not None:
                os.close(fd)
        self._bell = self._quit = None
        hold_ms = math.ceil(hold * 1000) if hold > 0 else 0
        return self.backend.leave(self.claim, hold_ms, own=own)


class KeptLease(NamedTuple):
    """A lease kept with no process (acquire --no-keeper), as any later process finds it.

    Its renewals and its release are the scripts a holder's would be: only the token
    is another process's.
    """

    backend: RedisBackend
    claim: Claim
    hold_ms: int  # --hold-at-least, counted from the grant on the server's clock

    def renew(self) -> None:
        """Extend the lease by its ttl; `LeaseLost` if it is gone.

        A take-over that waits is told here, as a holder's renewal is told: the lease is
        released at once, for the taker, and `TakenOver` says who it is.
        """
        reply = self.backend.call("renew", self.claim)
        if isinstance(reply, str):  # the taker's record
            self.backend.leave(self.claim)  # best effort: otherwise it lapses within a ttl
            msg = f"{_taken_over_by(reply)}; released it"
            raise TakenOver(msg)
        if reply != 1:
            raise LeaseLost(_KEPT_GONE)

    def release(self) -> tuple[str | None, float]:
        """Release, leaving the --hold-at-least window; `LeaseLost` if it was gone already.

        Proved held by a renewal first, as the release script is silent about a lease
        that lapsed: then 0 means held until the release. Return the record of a taker that
        waited (it runs next, and no window is left), else None, and the seconds of window
        left.
        """
        reply = self.backend.call("renew", self.claim)
        if reply != 1 and not isinstance(reply, str):
            raise LeaseLost(_KEPT_GONE)
        taker = reply if isinstance(reply, str) else None
        hold_ms = self._window() if self.hold_ms and taker is None else 0
        woken = self.backend.call("release", self.claim, hold_ms)
        self.backend.pass_over_the_dead(self.claim, woken)
        return taker, hold_ms / 1000

    def _window(self) -> int:
        """Return the ms of the --hold-at-least window left, from the grant in owners.

        An entry that is none of ours (another client wrote it) leaves the whole window
        from now: longer than asked, never shorter.
        """
        reply = self.backend.call("status", Claim(self.claim.prefix, "", 1, 1))
        server_ms = int(reply[0])
        owner = _OWNER.fullmatch(_pairs(reply[4]).get(self.claim.token, ""))
        granted = int(owner["granted"]) if owner else server_ms
        return max(0, min(granted + self.hold_ms - server_ms, self.hold_ms))


_KEPT_GONE: Final = (
    "no lease for this token: it expired (nobody renewed it within its --ttl), was "
    "released, or Redis lost it (FLUSHALL, eviction, a restart or failover)"
)


def _taken_over_by(record: str) -> str:
    """Return the reason a take-over gives, naming the taker from its *record* (anyone's)."""
    try:
        taker = Holder.from_dict(read_json(record))
    except ValueError:
        return "taken over by another lockrun, whose record is unreadable"
    return f"taken over by {taker.user}@{taker.host} pid {taker.pid}"
