-- inspect.lua: read a lock and its waiters, changing nothing.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (see common.lua for its value)
-- KEYS[2] -> <prefix>{<key>}:wait   waiters, as in lock.lua
-- ARGV[1] -> how many waiters to return, oldest first
--
-- Returns {value or false, pttl of the lock, length of the queue, the first ARGV[1]
-- entries of the queue, server time {seconds, microseconds}}.
local n = tonumber(ARGV[1])
local w = {}
if n > 0 then
  w = redis.call('LRANGE', KEYS[2], 0, n - 1)
end
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), redis.call('LLEN', KEYS[2]), w, redis.call('TIME')}
