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
-- ARGV[7] -> channel prefix, as in plain_release.lua
-- ARGV[8] -> "1" when PUBLISH counts every subscriber, as in plain_release.lua
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
-- the lock (its client was not listening). A free lock with waiters queued (their
-- holder's lease ran out: it crashed) goes to the oldest listening one, as a release
-- would have given it, not to whoever tries first: the caller takes it only when its
-- own entry comes first or nobody is left, and otherwise queues at the back. The queue is looked at before every push,
-- so that an attempt go-redis sends again after a lost reply does not queue the
-- waiter twice (a second entry would be handed the lock after the waiter released
-- it). The queue lives twice the holder's remaining lease plus a second past the last
-- attempt that queued someone; a waiter tries again by itself when that lease runs
-- out, which renews it.

-- enqueue puts entry e at the back of queue q, once, where it waits for a holder
-- whose lease has pttl ms left, and marks value v of lock as WAITED, so that its
-- release looks at the queue.
local function enqueue(lock, q, v, e, pttl)
  if not redis.call('LPOS', q, e) then
    redis.call('RPUSH', q, e)
  end
  redis.call('PEXPIRE', q, 2 * math.max(pttl, 1000) + 1000)
  if string.byte(v, STATE_AT) == HELD then
    redis.call('SET', lock, withState(v, WAITED), 'KEEPTTL')
  end
end

-- serve gives lock, free (v is nil or a tombstone, whose next holder names prev as
-- the previous one), to the oldest listening waiter of queue q, if any: see handOver
-- (plain.lua); self is the caller's own entry, or nil. Returns what handOver does; when nobody was left, the lock is free again (a
-- tombstone of the same releaser when handOver wrote waiters nobody heard over it).
local function serve(lock, q, v, prev, self)
  local served, last = handOver(lock, q, v, prev, ARGV[7], ARGV[8], self)
  if not served and last ~= v then
    local r, p = NO_DESCRIPTION, ''
    if v then
      r, p = holder(v)
    end
    redis.call('SET', lock, tombstone(last, r, p), 'KEEPTTL')
  end
  return served, last
end

-- take takes lock (queue q) or queues the waiter (head, its entry's head; "" for
-- none); it returns the fence (0: busy, -1: a lock with Limit(n) holds the key) and
-- the remaining lease of the holder.
local function take(lock, q, id, ttl, head, queued, desc)
  local v = redis.pcall('GET', lock)
  if type(v) == 'table' then -- an error: a lock with Limit(n), a hash, holds the key
    return -1, 0
  end
  local e = nil
  if head ~= '' then
    e = head .. ' ' .. id .. desc
  end
  if v and held(v) then
    if ours(v, id) then
      redis.call('PEXPIRE', lock, ttl)
      if queued == '1' then
        redis.call('LREM', q, 0, e)
      end
      return fenceOf(v), 0
    end
    local pttl = redis.call('PTTL', lock)
    if e then
      enqueue(lock, q, v, e, pttl)
    end
    return 0, pttl
  end
  -- Free: absent, or a tombstone, which goes now.
  markReleased(lock, v)
  local prev = previous(v)
  local served, last = serve(lock, q, v, prev, e)
  if served == 'other' then
    local pttl = redis.call('PTTL', lock)
    if e then
      enqueue(lock, q, redis.call('GET', lock), e, pttl)
    end
    return 0, pttl
  end
  local state = HELD
  if served == 'self' then
    state = WAITED -- others may be queued behind us
  end
  local f, now = nextFence(last)
  redis.call('SET', lock, value(f, state, now, id .. desc, prev), 'PX', ttl)
  return f, 0
end

local n = #KEYS / 2
if ARGV[6] == '1' and n > 1 then
  -- All or none: find a busy lock before taking any. A free lock with listening
  -- waiters is busy: it goes to them.
  for i = 1, n do
    local lock, q = KEYS[2 * i - 1], KEYS[2 * i]
    local v = redis.pcall('GET', lock)
    if type(v) == 'table' then
      return {-1, 0, i}
    end
    if v and held(v) then
      if not ours(v, ARGV[1]) then
        return {0, redis.call('PTTL', lock), i}
      end
    elseif serve(lock, q, v, previous(v), nil) == 'other' then
      markReleased(lock, v)
      return {0, redis.call('PTTL', lock), i}
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
