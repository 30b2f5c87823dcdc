-- release.lua: release the lock if our token holds it, then wake the next waiter.
--
-- KEYS[1] -> <prefix>{<key>}        the lock; value "<fence>:<token>", or "-:<token>" once released
-- KEYS[2] -> <prefix>{<key>}:wait   waiters: sorted set of "<client>.<waiter>" by time first queued (ms)
-- KEYS[3] -> <prefix>{<key>}:claim  waiters: hash of "<client>.<waiter>" to claim deadline (ms)
-- ARGV[1] -> token; or "" to only pass a wake-up on: wake the next waiter if the lock is free
-- ARGV[2] -> channel prefix: a client <c> listens on ARGV[2] .. <c>
-- ARGV[3] -> "1" when PUBLISH counts every subscriber (not in Redis Cluster, where it
--            counts those of this node only)
-- ARGV[4] -> how long the tombstone of a release stays, in milliseconds
--
-- Returns 1 when released, 0 when the key is gone or holds another token (then the
-- lock is not touched). A release leaves the tombstone "-:<token>", which every script
-- treats as a free lock, so that a release repeated after a lost reply (go-redis
-- retries on a new connection) returns 1 again instead of reporting a lost lease.
--
-- The longest-queued waiter whose claim has not lapsed is removed from the queue and
-- its client gets "<waiter> <lock key>" on its channel: one release wakes one waiter
-- among all clients. When no subscriber received it (that client died or is
-- reconnecting), the next waiter is tried, so a dead waiter cannot swallow a release.
local released = 0
local v = redis.call('GET', KEYS[1])
local held = v and string.byte(v, 1) ~= 45
if ARGV[1] ~= '' then
  if v == '-:' .. ARGV[1] then
    return 1 -- this release was applied already and its reply lost
  end
  if not (held and string.sub(v, (string.find(v, ':', 1, true) or #v) + 1) == ARGV[1]) then
    return 0
  end
  redis.call('SET', KEYS[1], '-:' .. ARGV[1], 'PX', ARGV[4])
  released = 1
elseif held then
  return 0
end
local now
for _ = 1, 16 do
  local w = redis.call('ZPOPMIN', KEYS[2])
  if not w[1] then
    break
  end
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  local claim = tonumber(redis.call('HGET', KEYS[3], w[1]))
  redis.call('HDEL', KEYS[3], w[1])
  local dot = string.find(w[1], '.', 1, true)
  if claim and claim >= now and dot then
    local got = redis.call('PUBLISH', ARGV[2] .. string.sub(w[1], 1, dot - 1), string.sub(w[1], dot + 1) .. ' ' .. KEYS[1])
    if got > 0 or ARGV[3] ~= '1' then
      break
    end
  end
end
return released
