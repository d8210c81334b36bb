-- acquire: queue for a slot, or take one.
-- ARGV[5]: our holder record (JSON); ARGV[6]: the mode, 'try', 'wait' or 'take' (a wait
--   with --take-over); ARGV[7]: our connection's CLIENT ID, or '' (a try names none).
-- → {code, number, number, number, text, then the {token, CLIENT ID} pairs of the other
--   waiters it woke}:
--   {1, slot, fence (0 for a reader), 0, ''}: granted;
--   {0, rank, ms until a lease or a place ahead of us may lapse, ms the lock stays taken
--    whatever happens (a --hold-at-least window), ''}: queued (in 'try' mode, not queued);
--   {-1, N in use, 0, 0, ''}: live users of the name have another N;
--   {2, 0, 0, 0, the taker's record}: granted while a take-over was pending, and given back
--    at once, for the taker.
-- scripts.decode_acquire reads it.

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
-- #include machinery.lua

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
