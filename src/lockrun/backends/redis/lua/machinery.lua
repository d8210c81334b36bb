-- The general path: what every script but the fast paths shares. Included where a script
-- says "#include machinery.lua", after its fast path.

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
