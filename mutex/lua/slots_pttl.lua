-- slots_pttl.lua: remaining lease of the slot our identity holds in a lock with
-- Limit(n) (see slots.lua).
--
-- KEYS[1] -> <prefix>{<key>}  the holders (a HASH, layout.go)
-- ARGV[1] -> identity of the holder
--
-- Returns the remaining lease in milliseconds, or -3 when our identity holds no slot
-- whose lease is running.
if keyType(KEYS[1]) ~= 'hash' then
  return -3
end
local ms = math.floor(serverMicros() / 1000)
local v = redis.call('HGET', KEYS[1], SLOT_HOLDER .. ARGV[1])
local e = v and tonumber(string.match(v, '^%d+')) or 0
if e <= ms then
  return -3
end
return e - ms
