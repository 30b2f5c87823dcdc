-- plain.lua: what the scripts of a plain lock (one key, or a set of keys taken as
-- one) share after common.lua and line.lua.
--
-- A plain lock's value is a string (layout.go); its waiters queue at <lock>:wait,
-- oldest first, in entries as layout.go describes them.

-- handOver gives the lock, whose value is v (nil when absent), to the oldest waiter in
-- queue q whose client is listening, or to the oldest parked task: the entry is taken
-- out, the lock is set to its identity with a new fence and its own lease; a
-- waiter's client gets "<waiter> <fence>" on channel chan .. <client>, and a parked
-- task's ticket is added to start, as "<i> <mark><ticket>" (i, the lock's place in
-- the call; mark, the entry's), for the caller's Starter to start it; it claims the
-- lock when it arrives (plain_lock.lua). Then the parked task at the head of the
-- queue, if any, is started ahead of its turn (prestart). A nil start (a caller that
-- starts nothing: a release by force) collects no ticket and starts nobody ahead. When no subscriber received
-- a waiter's message (the client died or is reconnecting), the next entry is tried,
-- so dead waiters cannot swallow a release; the waiter passed over tries again by
-- itself once it listens again; so is an entry of prev, the releaser. PUBLISH counts
-- every subscriber only when counts is "1" (not in Redis Cluster, where it counts
-- those of one node). The new value names prev as the previous holder. Entries of
-- another form, or with a lease that is not a positive number, are dropped. self is
-- the caller's own entry, or nil, and ticket its ticket, or nil: when its entry (or a
-- parked entry of its ticket) comes up, it is taken out and nothing else is done.
-- Returns "other" when a waiter or parked task got the lock; "self" when the caller's
-- entry came first; nil when nobody was left, and the last value given to a waiter
-- nobody heard (or v), so that what comes next keeps the highest fence.
local function handOver(lock, q, v, prev, chan, counts, self, ticket, start, i)
  while true do
    local e = redis.call('LPOP', q)
    if not e then
      return nil, v
    end
    if e == self then
      return 'self', v
    end
    local mark, t = parkedEntry(e)
    if mark and t == ticket then
      return 'self', v
    end
    local client, waiter, ls, who = entry(e)
    local lease = tonumber(ls)
    if mark then
      who = afterSince(who)
    end
    -- An entry of the releaser itself (prev) is left out: it is one the releaser's
    -- own wait left behind, and handing it the lock it gives up would keep the lock
    -- held by nobody.
    if who and lease and lease > 0 and (prev == '' or string.sub(who, 1, #prev) ~= prev) then
      local f, now = nextFence(v)
      local nv = value(f, WAITED, now, who, prev)
      redis.call('SET', lock, nv, 'PX', lease)
      if mark then
        if start then
          start[#start + 1] = i .. ' ' .. mark .. t
          prestart(q, start, i)
        end
        return 'other', nv
      end
      local got = redis.call('PUBLISH', chan .. client, waiter .. ' ' .. string.sub(nv, 1, FENCE_DIGITS))
      if got > 0 or counts ~= '1' then
        if start then
          prestart(q, start, i)
        end
        return 'other', nv
      end
      v = nv
    end
  end
end

-- letGo releases lock, whose value v identity r holds, as a release does: to the
-- oldest listening waiter or parked task of queue q when v says someone waits
-- (handOver, whose chan, counts, start and i it passes on), else leaving a tombstone
-- for ms milliseconds. It reports whether the lock was handed over.
local function letGo(lock, q, v, r, chan, counts, start, i, ms)
  if string.byte(v, STATE_AT) == WAITED then
    local given
    given, v = handOver(lock, q, v, r, chan, counts, nil, nil, start, i)
    if given then
      return true
    end
  end
  redis.call('SET', lock, tombstone(v, r, ''), 'PX', ms)
  return false
end

-- previous is whom a lock taken from value v (nil, or a tombstone) names as its
-- previous holder: the releaser, so that its release repeated after a lost reply is
-- recognised; or, after a release by force, the mark of the old holder
-- (plain_force.lua), kept so that the old holder's release learns what happened.
local function previous(v)
  if not v then
    return ''
  end
  local h, p = holder(v)
  return string.byte(p, 1) == FORCED and p or h
end

-- serve gives lock, free (v is nil or a tombstone, whose next holder names prev as
-- the previous one), to the oldest listening waiter or parked task of queue q, if
-- any: see handOver, whose chan, counts, self, ticket, start and i it passes on.
-- Returns what handOver does; when nobody was left, the lock is free again (a
-- tombstone of the same releaser when handOver wrote waiters nobody heard over it).
local function serve(lock, q, v, prev, chan, counts, self, ticket, start, i)
  local served, last = handOver(lock, q, v, prev, chan, counts, self, ticket, start, i)
  if not served and last ~= v then
    local r, p = NO_DESCRIPTION, ''
    if v then
      r, p = holder(v)
    end
    redis.call('SET', lock, tombstone(last, r, p), 'KEEPTTL')
  end
  return served, last
end
