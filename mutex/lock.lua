-- lock.lua: take the lock if it is free, or confirm that it is already ours; when it
-- is not, queue the caller as a waiter to be handed the lock by a release.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (see common.lua for its value); expires after the lease
-- KEYS[2] -> <prefix>{<key>}:wait   waiters: list of "<client>.<waiter> <lease ms> <identity><description>",
--                                   oldest first
-- ARGV[1] -> identity of this acquisition: its token's length in 4 digits, then the token
-- ARGV[2] -> lease in milliseconds
-- ARGV[3] -> waiter to queue if the lock is busy, "<client>.<waiter> <lease ms>" (the lease a
--            release hands it), or "" to queue nobody
-- ARGV[4] -> "1" if an earlier attempt of this waiter may have queued it
-- ARGV[5] -> the holder's description: its length in 4 digits, then the text
--
-- Both keys share the hash tag, so one Redis Cluster slot.
-- Returns {fence, 0} when the lock is ours, {0, pttl} when another token holds it
-- (pttl is -1 when the key has no expiry).
--
-- A key that already holds our token counts as ours (its lease is reset): a client
-- that retried after a lost reply must not report "not obtained" while its first
-- attempt holds the key, and a waiter the lock was handed to learns it here if the
-- hand-over's message did not reach it.
--
-- A waiter is queued once, at the back, and keeps its place while it retries; a
-- retry queues it again only if a release took it out of the queue without handing it
-- the lock (its client was not listening). The queue lives twice the holder's
-- remaining lease plus a second past the last attempt that queued someone; a waiter
-- tries again by itself when that lease runs out, which renews it.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 17) ~= 114 then -- held ("r" is a tombstone)
  if ours(v, ARGV[1]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    if ARGV[4] == '1' then
      redis.call('LREM', KEYS[2], 1, ARGV[3] .. ' ' .. ARGV[1] .. ARGV[5])
    end
    return {tonumber(string.sub(v, 1, 16)), 0}
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if ARGV[3] ~= '' then
    local entry = ARGV[3] .. ' ' .. ARGV[1] .. ARGV[5]
    if ARGV[4] ~= '1' or not redis.call('LPOS', KEYS[2], entry) then
      redis.call('RPUSH', KEYS[2], entry)
    end
    redis.call('PEXPIRE', KEYS[2], 2 * math.max(pttl, 1000) + 1000)
    if string.byte(v, 17) == 104 then -- "h": a release must now look at the queue
      redis.call('SET', KEYS[1], string.sub(v, 1, 16) .. 'w' .. string.sub(v, 18), 'KEEPTTL')
    end
  end
  return {0, pttl}
end
-- Free: absent, or a tombstone whose releaser we keep as the previous holder. The
-- queue is not looked at: waiters queued behind a holder whose lease ran out try
-- again by themselves as it runs out, and one that finds us holding the key marks it
-- "w" when it queues, so our release hands the lock on.
local state = 'h'
if ARGV[4] == '1' then
  redis.call('LREM', KEYS[2], 1, ARGV[3] .. ' ' .. ARGV[1] .. ARGV[5])
  state = 'w' -- others may be queued behind us
end
-- The releaser becomes the previous holder, unless the tombstone is of a release by
-- force: then its mark of the old holder is kept (see common.lua).
local prev = ''
if v then
  local id, p = holder(v)
  prev = string.byte(p, 1) == 33 and p or id
end
local f, now = nextFence(v)
redis.call('SET', KEYS[1], value(f, state, now, ARGV[1] .. ARGV[5], prev), 'PX', ARGV[2])
return {f, 0}
