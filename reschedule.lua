-- reschedule.lua: count a conflict of a task under RetryLater, or read the count, on
-- the Redis server's clock, so that every worker counts alike.
--
-- KEYS[1] -> <prefix>reschedule:<queue>:<task ID>   the task's record, a hash:
--              n     -> conflicts counted so far
--              first -> server time of the first, in milliseconds
--            It expires ARGV[1] ms after the last conflict counted. One key, so one
--            Redis Cluster slot.
-- ARGV[1] -> expiry in milliseconds
-- ARGV[2] -> "count": count this conflict
--            "last":  count it, then delete the record (asynq archives the task)
--            "peek":  change nothing
--
-- Returns {n, ms since the first conflict}; {0, 0} when "peek" finds no record. A
-- server clock that went back counts as no time passed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, first
if ARGV[2] == 'peek' then
  local r = redis.call('HMGET', KEYS[1], 'n', 'first')
  n, first = tonumber(r[1]), tonumber(r[2])
  if not n then
    return {0, 0}
  end
else
  n = redis.call('HINCRBY', KEYS[1], 'n', 1)
  if redis.call('HSETNX', KEYS[1], 'first', now) == 0 then
    first = tonumber(redis.call('HGET', KEYS[1], 'first'))
  end
  if ARGV[2] == 'last' then
    redis.call('DEL', KEYS[1])
  else
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
  end
end
return {n, math.max(now - (first or now), 0)}
