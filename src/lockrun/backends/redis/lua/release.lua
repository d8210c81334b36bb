-- release: give back a slot or leave the queue, whichever the token has; grant to who is next.
-- ARGV[5]: the hold in ms (--hold-at-least): a slot held is kept taken until the server's
--   now + hold, marked as a window in owners ("SLOT FENCE GRANTED UNTIL"), and nothing is
--   granted; the head of the queue is woken to sleep until the window ends. A release while
--   a take-over is pending leaves no window: the taker asked for the lock now.
-- ARGV[6]: '1' if the caller's connection tracked the stop key (a lease's bell): the key is
--   then written, which is what ends Redis's tracking of it for every connection that ever
--   read it (CLIENT TRACKING OFF does not; a lock's users would pile up in the table).
-- → the {token, CLIENT ID} pairs of the waiters it woke (scripts.decode_woken).

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
-- #include machinery.lua

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
