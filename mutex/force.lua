-- force.lua: release the lock whoever holds it, for an operator freeing a stuck key.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (see common.lua for its value)
-- KEYS[2] -> <prefix>{<key>}:wait   waiters, as in lock.lua
-- ARGV[1] -> identity the release is made under: a fresh token no holder has
-- ARGV[2] -> channel prefix, as in release.lua
-- ARGV[3] -> "1" when PUBLISH counts every subscriber, as in release.lua
-- ARGV[4] -> how long the tombstone stays, in milliseconds
--
-- Returns {value before, fence after}: the value is false when nobody held the lock
-- (then nothing changes); the fence after is the new holder's when the lock was handed
-- to a waiter, 0 when it became a tombstone.
--
-- Afterwards the old holder's token holds nothing: its Extend and Unlock find another
-- identity and fail, and every later holder's fence is higher than its own.
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 17) == 114 then
  return {false, 0}
end
local state = string.byte(v, 17)
if #v < 37 or (state ~= 104 and state ~= 119) then -- not of our form: set by hand
  redis.call('DEL', KEYS[1])
  return {v, 0}
end
if state == 119 and handOver(KEYS[1], KEYS[2], v, ARGV[1], ARGV[2], ARGV[3]) then
  return {v, tonumber(string.sub(redis.call('GET', KEYS[1]), 1, 16))}
end
redis.call('SET', KEYS[1], tombstone(v, ARGV[1]), 'PX', ARGV[4])
return {v, 0}
