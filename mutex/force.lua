-- force.lua: release the lock whoever holds it, for an operator freeing a stuck key.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (see common.lua for its value)
-- KEYS[2] -> <prefix>{<key>}:wait   waiters, as in lock.lua
-- ARGV[1] -> identity the release is made under: a fresh token no holder has
-- ARGV[2] -> channel prefix, as in release.lua
-- ARGV[3] -> "1" when PUBLISH counts every subscriber, as in release.lua
-- ARGV[4] -> how long the tombstone stays, in milliseconds
--
-- Returns, read before anything changed, {value or false, pttl, length of the queue,
-- {}, server time}, as inspect.lua does, followed by the value after when the lock was
-- handed to a waiter (false otherwise), and 1 when this release was applied before
-- (a repeat after a lost reply: then nothing changes, and the rest says nothing of
-- the old holder), 0 otherwise. When nobody held the lock nothing changes.
--
-- Afterwards the old holder's token holds nothing: its Extend finds another identity
-- and fails, its Unlock returns 2 (see release.lua), and every later holder's fence is
-- higher than its own. The mark "!" .. old identity .. ARGV[1] that the next value
-- carries as its previous holder (kept by the holder after, see lock.lua) tells the
-- old holder's release what happened, and a repeat of this call that it was applied.
local v = redis.call('GET', KEYS[1])
if v then
  local id, p = holder(v)
  if id == ARGV[1] or (string.byte(p, 1) == 33 and string.sub(p, -#ARGV[1]) == ARGV[1]) then
    return {false, 0, 0, {}, redis.call('TIME'), false, 1}
  end
end
local before = {v, redis.call('PTTL', KEYS[1]), redis.call('LLEN', KEYS[2]), {}, redis.call('TIME'), false, 0}
if not v or string.byte(v, 17) == 114 then
  return before
end
local state = string.byte(v, 17)
if #v < 37 or (state ~= 104 and state ~= 119) then -- not of our form: set by hand
  redis.call('DEL', KEYS[1])
  return before
end
-- The next value names the old holder, marked, as the previous one: its release
-- then learns that it was released by force (see release.lua).
local old = '!' .. holder(v) .. ARGV[1]
local last = v
if state == 119 then
  local given
  given, last = handOver(KEYS[1], KEYS[2], v, old, ARGV[2], ARGV[3])
  if given then
    before[6] = redis.call('GET', KEYS[1])
    return before
  end
end
redis.call('SET', KEYS[1], tombstone(last, ARGV[1], old), 'PX', ARGV[4])
return before
