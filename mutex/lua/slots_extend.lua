-- slots_extend.lua: reset the lease of the slot our identity holds in a lock with
-- Limit(n) (see slots.lua).
--
-- KEYS[1] -> <prefix>{<key>}  the holders (a HASH, layout.go)
-- ARGV[1] -> identity of the holder
-- ARGV[2] -> new lease in milliseconds (replaces the remaining one)
--
-- Returns 1 when extended, 0 when our identity holds no slot whose lease is running
-- (then nothing changes). Safe to repeat.
if keyType(KEYS[1]) ~= 'hash' then
  return 0
end
local ms = math.floor(serverMicros() / 1000)
local v = redis.call('HGET', KEYS[1], SLOT_HOLDER .. ARGV[1])
if not v or (tonumber(string.match(v, '^%d+')) or 0) <= ms then
  return 0
end
local lease = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], SLOT_HOLDER .. ARGV[1], string.format('%d', ms + lease) .. string.match(v, '^%d+(.*)$'))
local p = redis.call('PTTL', KEYS[1])
if p >= 0 and p < lease then
  redis.call('PEXPIRE', KEYS[1], lease)
end
return 1
