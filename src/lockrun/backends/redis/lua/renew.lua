-- renew: extend our lease by a ttl.
-- ARGV: the prelude's alone.
-- → 1: extended; 0: lost; the taker's record: extended, but a take-over asks us to stop.
-- An expired lease is lost even before anyone reaped it, and so is a window
-- (--hold-at-least): its run has ended, and a renewal that arrives after the release revives
-- nothing (P4). scripts.decode_renew reads it.
-- #include machinery.lua

local expiry = redis.call('ZSCORE', holders, token)
if not expiry or tonumber(expiry) <= now then return 0 end
if string.find(redis.call('HGET', owners, token) or '', '^%d+ %d+ %d+ ') then return 0 end
redis.call('ZADD', holders, 'XX', now + ttl, token)
tidy()
local taker, record = stopper()
if taker and taker ~= token then return record end
return 1
