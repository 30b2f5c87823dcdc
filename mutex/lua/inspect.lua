-- inspect.lua: read a lock of either kind and its waiters, changing nothing.
--
-- KEYS[1] -> <prefix>{<key>}         the lock: a plain lock's string, or the hash of a
--                                    lock with Limit(n) (layout.go)
-- KEYS[2] -> <prefix>{<key>}:wait    a plain lock's waiters
-- KEYS[3] -> <prefix>{<key>}:slots   the waiters of a lock with Limit(n)
-- ARGV[1] -> how many waiters to return, oldest first
--
-- Returns {type, value, pttl of the lock, length of the queue, the first ARGV[1]
-- entries of the queue, server time {seconds, microseconds}}: for a plain lock (type
-- "string", or "none" when the key is absent) the value or false, and its queue; for
-- a lock with Limit(n) ("hash") its fields and values (HGETALL), holders whose lease
-- has ended included (the reader compares their lease end with the server time), and
-- its queue; for a key of another type, its type and nothing else.
local t = keyType(KEYS[1])
local v, q = false, KEYS[2]
if t == 'string' then
  v = redis.call('GET', KEYS[1])
elseif t == 'hash' then
  v, q = redis.call('HGETALL', KEYS[1]), KEYS[3]
elseif t ~= 'none' then
  return {t, false, 0, 0, {}, redis.call('TIME')}
end
local n = tonumber(ARGV[1])
local w = {}
if n > 0 then
  w = redis.call('LRANGE', q, 0, n - 1)
end
return {t, v, redis.call('PTTL', KEYS[1]), redis.call('LLEN', q), w, redis.call('TIME')}
