-- plain_lock.lua: take the locks if they are free, or confirm that they are already
-- ours; when one is not, queue the caller as its waiter, to be handed it by a release.
--
-- KEYS[2i-1] -> <prefix>{<key i>}        lock i (layout.go); expires after the lease
-- KEYS[2i]   -> <prefix>{<key i>}:wait   its waiters, oldest first (layout.go)
-- One lock, or several taken as one, in the order given (the caller sorts them, so
-- that everyone takes overlapping sets in one order).
-- ARGV[1] -> identity of this acquisition
-- ARGV[2] -> lease in milliseconds
-- ARGV[3] -> head of the waiter's queue entry, to queue it if a lock is busy
--            ("<client>.<waiter> <lease ms>"), or "" to queue nobody
-- ARGV[4] -> "1" if an earlier attempt of this waiter may have queued it
-- ARGV[5] -> the holder's description, counted
-- ARGV[6] -> "1" to take all locks or none; otherwise the locks before a busy one are
--            taken (kept, renewed) while the caller waits for it
--
-- A lock and its queue share a hash tag, so one Redis Cluster slot; several locks are
-- in several slots, so in Redis Cluster the caller sends one lock per call.
-- Returns {fence 1, ..., fence n} when all locks are ours; {0, pttl, i} when lock i
-- is the first that another token holds (pttl is -1 when the key has no expiry);
-- {-1, 0, i} when lock i is a lock with Limit(n) (a hash, see slots.lua).
--
-- A key that already holds our token counts as ours (its lease is reset): a client
-- that retried after a lost reply must not report "not obtained" while its first
-- attempt holds the key, and a waiter the lock was handed to learns it here if the
-- hand-over's message did not reach it.
--
-- A waiter is queued once, at the back, and keeps its place while it retries; a
-- retry queues it again only if a release took it out of the queue without handing it
-- the lock (its client was not listening). The queue is looked at before every push,
-- so that an attempt go-redis sends again after a lost reply does not queue the
-- waiter twice (a second entry would be handed the lock after the waiter released
-- it). The queue lives twice the holder's remaining lease plus a second past the last
-- attempt that queued someone; a waiter tries again by itself when that lease runs
-- out, which renews it.

-- take takes lock (queue q) or queues the waiter; it returns the fence (0: busy, -1:
-- a hash) and the remaining lease of the holder.
local function take(lock, q, id, ttl, head, queued, desc)
  local v = redis.pcall('GET', lock)
  if type(v) == 'table' then -- an error: a lock with Limit(n), a hash, holds the key
    return -1, 0
  end
  if v and held(v) then
    if ours(v, id) then
      redis.call('PEXPIRE', lock, ttl)
      if queued == '1' then
        redis.call('LREM', q, 0, head .. ' ' .. id .. desc)
      end
      return fenceOf(v), 0
    end
    local pttl = redis.call('PTTL', lock)
    if head ~= '' then
      local e = head .. ' ' .. id .. desc
      if not redis.call('LPOS', q, e) then
        redis.call('RPUSH', q, e)
      end
      redis.call('PEXPIRE', q, 2 * math.max(pttl, 1000) + 1000)
      if string.byte(v, STATE_AT) == HELD then -- a release must now look at the queue
        redis.call('SET', lock, withState(v, WAITED), 'KEEPTTL')
      end
    end
    return 0, pttl
  end
  -- Free: absent, or a tombstone whose releaser we keep as the previous holder. The
  -- queue is not looked at: waiters queued behind a holder whose lease ran out try
  -- again by themselves as it runs out, and one that finds us holding the key marks it
  -- WAITED when it queues, so our release hands the lock on.
  local state = HELD
  if queued == '1' then
    redis.call('LREM', q, 0, head .. ' ' .. id .. desc)
    state = WAITED -- others may be queued behind us
  end
  -- The releaser becomes the previous holder, unless the tombstone is of a release by
  -- force: then its mark of the old holder is kept (see force.lua).
  local prev = ''
  if v then
    local h, p = holder(v)
    prev = string.byte(p, 1) == FORCED and p or h
  end
  local f, now = nextFence(v)
  redis.call('SET', lock, value(f, state, now, id .. desc, prev), 'PX', ttl)
  return f, 0
end

local n = #KEYS / 2
if ARGV[6] == '1' and n > 1 then
  for i = 1, n do
    local v = redis.pcall('GET', KEYS[2 * i - 1])
    if type(v) == 'table' then
      return {-1, 0, i}
    end
    if v and held(v) and not ours(v, ARGV[1]) then
      return {0, redis.call('PTTL', KEYS[2 * i - 1]), i}
    end
  end
end
local fences = {}
for i = 1, n do
  local f, pttl = take(KEYS[2 * i - 1], KEYS[2 * i], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
  if f <= 0 then
    return {f, pttl, i}
  end
  fences[i] = f
end
return fences
