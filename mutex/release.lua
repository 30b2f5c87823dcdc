-- release.lua: release the lock if our token holds it, handing it to the oldest
-- waiter whose client is listening.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (see common.lua for its value)
-- KEYS[2] -> <prefix>{<key>}:wait   waiters: list of "<client>.<waiter> <lease ms> <identity>", oldest first
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
-- ARGV[2] -> a waiter that gives up, to take out of the queue first (its entry as
--            lock.lua wrote it), or "" for a plain release
-- ARGV[3] -> channel prefix: a client <c> listens on ARGV[3] .. <c>
-- ARGV[4] -> "1" when PUBLISH counts every subscriber (not in Redis Cluster, where it
--            counts those of this node only)
-- ARGV[5] -> how long the tombstone of a release stays, in milliseconds
--
-- Returns 1 when released, 0 when the key is gone or holds another token (then the
-- lock is not touched).
--
-- A release that finds its own tombstone, or finds the lock handed over by itself
-- (the previous holder), returns 1 again: it was applied already and its reply lost.
--
-- Hand-over: the oldest waiter is taken out of the queue, the lock is set to its
-- identity with a new fence and its own lease, and its client gets
-- "<waiter> <fence>" on its channel. When no subscriber received that (the client
-- died or is reconnecting), the next waiter is tried, so dead waiters cannot swallow
-- a release; the waiter passed over tries again by itself once it listens again.
-- When nobody is left, the lock becomes a tombstone.
if ARGV[2] ~= '' then
  redis.call('LREM', KEYS[2], 1, ARGV[2])
end
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local state = string.byte(v, 17)
if not ours(v, ARGV[1]) then
  if ARGV[2] == '' and state ~= 114 then
    local _, prev = holder(v)
    if prev == ARGV[1] then
      return 1
    end
  end
  return 0
end
if state == 114 then
  return 1
end
if state == 119 then -- "w"
  while true do
    local e = redis.call('LPOP', KEYS[2])
    if not e then
      break
    end
    local dot = string.find(e, '.', 1, true)
    local s1 = string.find(e, ' ', 1, true)
    local s2 = s1 and string.find(e, ' ', s1 + 1, true)
    if dot and s2 and dot < s1 then
      v = value(nextFence(v), 'w', string.sub(e, s2 + 1), ARGV[1])
      redis.call('SET', KEYS[1], v, 'PX', string.sub(e, s1 + 1, s2 - 1))
      local got = redis.call('PUBLISH', ARGV[3] .. string.sub(e, 1, dot - 1),
        string.sub(e, dot + 1, s1 - 1) .. ' ' .. string.sub(v, 1, 16))
      if got > 0 or ARGV[4] ~= '1' then
        return 1
      end
    end
  end
end
redis.call('SET', KEYS[1], string.sub(v, 1, 16) .. 'r' .. ARGV[1], 'PX', ARGV[5])
return 1
