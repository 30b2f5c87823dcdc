-- release.lua: release the lock if our token holds it, handing it to the oldest
-- waiter whose client is listening.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (see common.lua for its value)
-- KEYS[2] -> <prefix>{<key>}:wait   waiters: list of "<client>.<waiter> <lease ms> <identity><description>",
--                                   oldest first
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
-- ARGV[2] -> a waiter that gives up, to take out of the queue first (its entry as
--            lock.lua wrote it), or "" for a plain release
-- ARGV[3] -> channel prefix: a client <c> listens on ARGV[3] .. <c>
-- ARGV[4] -> "1" when PUBLISH counts every subscriber (not in Redis Cluster, where it
--            counts those of this node only)
-- ARGV[5] -> how long the tombstone of a release stays, in milliseconds
--
-- Returns 1 when released, 0 when the key is gone or holds another token, 2 when our
-- lock was released by force (force.lua) since; in both of the latter cases the lock
-- is not touched.
--
-- A release that finds its own tombstone, or finds the lock handed over by itself
-- (the previous holder), returns 1 again: it was applied already and its reply lost.
-- The lock goes to the oldest listening waiter (see handOver in common.lua); when
-- nobody is left, it becomes a tombstone.
if ARGV[2] ~= '' then
  redis.call('LREM', KEYS[2], 1, ARGV[2])
end
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local state = string.byte(v, 17)
if not ours(v, ARGV[1]) then
  local _, prev = holder(v)
  if string.sub(prev, 1, #ARGV[1] + 1) == '!' .. ARGV[1] then -- "!" .. ours .. forcer's
    return 2
  end
  if ARGV[2] == '' and state ~= 114 and prev == ARGV[1] then
    return 1
  end
  return 0
end
if state == 114 then
  return 1
end
if state == 119 then -- "w"
  local given
  given, v = handOver(KEYS[1], KEYS[2], v, ARGV[1], ARGV[3], ARGV[4])
  if given then
    return 1
  end
end
redis.call('SET', KEYS[1], tombstone(v, ARGV[1], ''), 'PX', ARGV[5])
return 1
