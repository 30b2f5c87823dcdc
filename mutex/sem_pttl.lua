-- sem_pttl.lua: remaining lease of the slot our identity holds in a lock with
-- Limit(n) (see semaphore.lua).
--
-- KEYS[1] -> <prefix>{<key>}  the holders (a HASH, see semaphore.lua)
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
--
-- Returns the remaining lease in milliseconds, or -3 when our identity holds no slot
-- whose lease is running.
if semType(KEYS[1]) ~= 'hash' then
  return -3
end
local _, ms = semNow()
local v = redis.call('HGET', KEYS[1], 'h' .. ARGV[1])
local e = v and tonumber(string.match(v, '^%d+')) or 0
if e <= ms then
  return -3
end
return e - ms
