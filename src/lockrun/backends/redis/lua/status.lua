-- status: one consistent snapshot of a lock, read-only.
-- ARGV: the prelude's alone (the token is '').
-- → {server ms, N (or ''), holders with expiry, queue, owners (flat pairs), info (flat
--   pairs), waiters with expiry} (scripts.decode_status).

return {now, redis.call('GET', cfg) or '',
        redis.call('ZRANGE', holders, 0, -1, 'WITHSCORES'), redis.call('ZRANGE', queue, 0, -1),
        redis.call('HGETALL', owners), redis.call('HGETALL', info),
        redis.call('ZRANGE', waiters, 0, -1, 'WITHSCORES')}
