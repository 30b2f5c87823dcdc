-- count.lua: count a conflict of a task under RetryLater, or read the count, on
-- the Redis server's clock, so that every worker counts alike.
--
-- The key is made by Counter.Key in conflicts.go; the fields are written here only.
--
-- KEYS[1] -> <prefix>reschedule:<queue>:<task ID>   the task's record, a hash:
--              n     -> conflicts counted so far
--              first -> server time of the first, in milliseconds
--              last  -> the id of the last conflict counted
--            It expires ARGV[1] ms after the last conflict counted. One key, so one
--            Redis Cluster slot.
-- ARGV[1] -> expiry in milliseconds
-- ARGV[2] -> "count": count this conflict; "peek": change nothing
-- ARGV[3] -> with "count", an id of this conflict, unique to it: a call go-redis
--            sends again after a lost reply finds it as "last" and counts nothing more
--
-- Returns {n, ms since the first conflict}; {0, 0} when "peek" finds no record. A
-- server clock that went back counts as no time passed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 'n', 'first', 'last')
local n, first = tonumber(r[1]), tonumber(r[2])
if ARGV[2] == 'peek' then
  if not n then
    return {0, 0}
  end
elseif r[3] ~= ARGV[3] then
  n, first = (n or 0) + 1, first or now
  redis.call('HSET', KEYS[1], 'n', n, 'first', first, 'last', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return {n, math.max(now - (first or now), 0)}
