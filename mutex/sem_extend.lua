-- sem_extend.lua: reset the lease of the slot our identity holds in a lock with
-- Limit(n) (see semaphore.lua).
--
-- KEYS[1] -> <prefix>{<key>}  the holders (a HASH, see semaphore.lua)
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
-- ARGV[2] -> new lease in milliseconds (replaces the remaining one)
--
-- Returns 1 when extended, 0 when our identity holds no slot whose lease is running
-- (then nothing changes). Safe to repeat.
if semType(KEYS[1]) ~= 'hash' then
  return 0
end
local _, ms = semNow()
local v = redis.call('HGET', KEYS[1], 'h' .. ARGV[1])
if not v or (tonumber(string.match(v, '^%d+')) or 0) <= ms then
  return 0
end
local lease = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'h' .. ARGV[1], string.format('%d', ms + lease) .. string.match(v, '^%d+(.*)$'))
local p = redis.call('PTTL', KEYS[1])
if p >= 0 and p < lease then
  redis.call('PEXPIRE', KEYS[1], lease)
end
return 1
