-- lock.lua: take the lock if it is free, or confirm that it is already ours.
--
-- KEYS[1] -> <prefix>{<key>}        the lock; value "<fence>:<token>", expires after the lease
-- KEYS[2] -> <prefix>{<key>}:fence  the fencing counter, same hash slot as the lock
-- ARGV[1] -> token of this acquisition (non-empty, may contain ':')
-- ARGV[2] -> lease in milliseconds
-- ARGV[3] -> how long the fencing counter outlives the last acquisition, in milliseconds
--
-- Returns {fence, 0} when the lock is ours, {0, pttl} when another token holds it
-- (pttl is -1 when the key has no expiry).
--
-- A key that already holds our token counts as ours: a client that retried after a
-- lost reply must not report "not obtained" while its first attempt holds the key.
-- The fence is stored in the value so that such a retry returns the original fence.
-- When the counter is new (first use, or expired after ARGV[3] without locks) it is
-- seeded from the server clock in microseconds, so fences keep increasing across the
-- counter's expiry unless that clock goes backwards.
local v = redis.call('GET', KEYS[1])
if v then
  local i = string.find(v, ':', 1, true)
  if i and string.sub(v, i + 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {tonumber(string.sub(v, 1, i - 1)), 0}
  end
  return {0, redis.call('PTTL', KEYS[1])}
end
local f = redis.call('INCR', KEYS[2])
if f == 1 then
  local t = redis.call('TIME')
  f = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', KEYS[2], string.format('%d', f))
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], string.format('%d', f) .. ':' .. ARGV[1], 'PX', ARGV[2])
return {f, 0}
