-- plain.lua: what the scripts of a plain lock (one key, or a set of keys taken as
-- one) share after common.lua.
--
-- A plain lock's value is a string (layout.go); its waiters queue at <lock>:wait,
-- oldest first, in entries as layout.go describes them.

-- parkedEntry reads entry e as a parked one (layout.go): its mark (PARKED or
-- STARTED) and ticket, or nil for a waiter's entry.
local function parkedEntry(e)
  local m = string.sub(e, 1, 1)
  if (m ~= PARKED and m ~= STARTED) or string.sub(e, 2, 2) ~= '.' then
    return nil
  end
  local s = string.find(e, ' ', 3, true)
  if not s then
    return nil
  end
  return m, string.sub(e, 3, s - 1)
end

-- parkedId is the identity a lock holds while it is handed to ticket: as
-- parkedIdentity (layout.go) writes it.
local function parkedId(ticket)
  return string.format('%0' .. LEN_DIGITS .. 'd', #ticket + 1) .. PARKED .. ticket
end

-- afterSince is the rest of a parked entry after its lease, "<since> <who>", without
-- the since: who it is.
local function afterSince(rest)
  local s = string.find(rest, ' ', 1, true)
  return s and string.sub(rest, s + 1)
end

-- prestart asks for the task of the parked entry at the head of queue q, if any, to
-- be started ahead of its turn: the entry is marked STARTED and its ticket added to
-- start (see handOver), so that the task is on its way while the lock's holder
-- works, and waits for it in a worker, to be handed it as a waiter is.
local function prestart(q, start, i)
  local h = redis.call('LINDEX', q, 0)
  if h and string.sub(h, 1, 1) == PARKED and string.sub(h, 2, 2) == '.' then
    redis.call('LSET', q, 0, STARTED .. string.sub(h, 2))
    local _, ticket = parkedEntry(h)
    start[#start + 1] = i .. ' ' .. PARKED .. ticket
  end
end

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

-- keepQueue makes queue q live at least ms more: in one command where the server
-- has PEXPIRE's GT (Redis 7), in two before.
local function keepQueue(q, ms)
  if (tonumber(redis.REDIS_VERSION_NUM) or 0) >= 0x070000 then
    if redis.call('PEXPIRE', q, ms, 'GT') == 0 then
      redis.call('PEXPIRE', q, ms, 'NX') -- GT counts no expiry as infinite
    end
  elseif redis.call('PTTL', q) < ms then
    redis.call('PEXPIRE', q, ms)
  end
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
