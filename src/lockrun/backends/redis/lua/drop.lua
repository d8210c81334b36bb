-- drop: take back the slots granted to woken waiters that died.
-- ARGV[5…]: {token, CLIENT ID} pairs of woken waiters whose connections the caller found
--   gone. Forgets each that has neither claimed its slot nor asked again (from a new
--   connection) since, and grants to who is next.
-- → the {token, CLIENT ID} pairs it woke (scripts.decode_woken).
-- #include machinery.lua

local dead = {}
for i = 5, #ARGV, 2 do
  local who, client = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', owners, who) and redis.call('HGET', clients, who) == client then
    dead[#dead + 1] = who
  end
end
return hand_on(dead)
