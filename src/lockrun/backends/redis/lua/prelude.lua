-- The prelude of every script (scripts.py puts it first, after MAX_SLOTS and MAX_WINDOW).
-- KEYS: holders queue waiters ticket fence owners info n clients stop, all under the lock's
--   hash tag, lockrun:{NS/NAME}:… (docs/backends.md "Redis")
-- ARGV[1..4]: the key prefix, our token, N, the lease in ms; each script's own ARGV follow.
-- A token that starts with "s:" asks for, or holds, the lock shared (--shared): the mode
-- travels with the token through every key, and nobody can write a mode that is not one.
-- Numbers reach Lua as strings and leave it as doubles: a fence is formatted with %d before
-- it is stored, because Lua's own tostring() would round a 16-digit integer
-- (docs/design.md P27). Every redis.call costs the server about half a microsecond: the
-- common cases (a free lock taken, the only holder leaving with nobody waiting) come first in
-- each script and make only the calls their outcome needs; everything else takes the general
-- path (machinery.lua) below them.

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
