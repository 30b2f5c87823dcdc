-- lock.lua: take the lock if it is free, or confirm that it is already ours; when it
-- is not, queue the caller as a waiter to be woken by the release.
--
-- KEYS[1] -> <prefix>{<key>}        the lock; value "<fence>:<token>", expires after the lease;
--                                   "-:<token>" for a while after a release (see release.lua)
-- KEYS[2] -> <prefix>{<key>}:fence  the fencing counter
-- KEYS[3] -> <prefix>{<key>}:wait   waiters: sorted set of "<client>.<waiter>" by time first queued (ms)
-- KEYS[4] -> <prefix>{<key>}:claim  waiters: hash of "<client>.<waiter>" to claim deadline (ms)
-- ARGV[1] -> token of this acquisition (non-empty, may contain ':')
-- ARGV[2] -> lease in milliseconds
-- ARGV[3] -> lifetime of a new fencing counter in milliseconds
-- ARGV[4] -> waiter to queue if the lock is busy, or "" to queue nobody
-- ARGV[5] -> "1" if ARGV[4] may be queued already (remove it on success)
--
-- All keys share the hash tag, so one Redis Cluster slot.
-- Returns {fence, 0} when the lock is ours, {0, pttl} when another token holds it
-- (pttl is -1 when the key has no expiry).
--
-- A key that already holds our token counts as ours: a client that retried after a
-- lost reply must not report "not obtained" while its first attempt holds the key.
-- The fence is stored in the value so that such a retry returns the original fence.
-- A new counter is seeded from the server clock in microseconds and lives ARGV[3];
-- its successor is seeded the same way, so fences keep increasing as long as that
-- clock does not go back and a key sees fewer than a million acquisitions a second.
--
-- A waiter keeps its place in the queue (ZADD NX) while it retries. Its claim lasts
-- until a little after the holder's lease would end, when the waiter tries again by
-- itself and renews the claim; a release skips waiters whose claim lapsed.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) ~= 45 then -- "-:<token>" is a released lock's tombstone: free
  local i = string.find(v, ':', 1, true)
  if i and string.sub(v, i + 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {tonumber(string.sub(v, 1, i - 1)), 0}
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if ARGV[4] ~= '' then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local claim = math.floor(math.max(pttl, 1000) * 1.25) + 1000
    redis.call('ZADD', KEYS[3], 'NX', string.format('%d', now), ARGV[4])
    redis.call('HSET', KEYS[4], ARGV[4], string.format('%d', now + claim))
    if redis.call('PTTL', KEYS[3]) < claim then
      redis.call('PEXPIRE', KEYS[3], claim)
      redis.call('PEXPIRE', KEYS[4], claim)
    end
  end
  return {0, pttl}
end
local f = redis.call('INCR', KEYS[2])
if f == 1 then
  local t = redis.call('TIME')
  f = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', KEYS[2], string.format('%d', f), 'PX', ARGV[3])
end
if ARGV[5] == '1' then
  redis.call('ZREM', KEYS[3], ARGV[4])
  redis.call('HDEL', KEYS[4], ARGV[4])
end
redis.call('SET', KEYS[1], string.format('%d', f) .. ':' .. ARGV[1], 'PX', ARGV[2])
return {f, 0}
