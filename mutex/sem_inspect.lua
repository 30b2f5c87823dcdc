-- sem_inspect.lua: read a lock with Limit(n) (see semaphore.lua) and its waiters,
-- changing nothing.
--
-- KEYS[1] -> <prefix>{<key>}        the holders (a HASH, see semaphore.lua)
-- KEYS[2] -> <prefix>{<key>}:slots  waiters, as in lock.lua but with "<lease ms>/<limit>"
-- ARGV[1] -> how many waiters to return, oldest first
--
-- Returns {the hash's fields and values (HGETALL), or {} when the key is no hash,
-- pttl of the key, length of the queue, the first ARGV[1] entries of the queue,
-- server time {seconds, microseconds}}. Holders whose lease has ended are still in
-- the fields: the reader compares their lease end with the server time.
local n = tonumber(ARGV[1])
local w = {}
if n > 0 then
  w = redis.call('LRANGE', KEYS[2], 0, n - 1)
end
local all = {}
if semType(KEYS[1]) == 'hash' then
  all = redis.call('HGETALL', KEYS[1])
end
return {all, redis.call('PTTL', KEYS[1]), redis.call('LLEN', KEYS[2]), w, redis.call('TIME')}
