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
-- ARGV[9] -> the ticket of a task that may park in the line (Park), or "" for none
-- ARGV[10] -> with a ticket: the claim, the lease in ms a hand-over gives it
-- ARGV[11] -> with a ticket: the description of its task, counted
-- ARGV[12] -> with a ticket, what the caller does at a busy lock: "lead" waits in the
--            queue if nobody else does (an entry other than a parked one), and parks
--            otherwise; "wait" waits; "park" parks now, in its own entry's place if it
--            has one
-- ARGV[13] -> with a ticket, where several locks are taken in calls of their own
--            (Redis Cluster): "ask" replies {-4, pttl, i} at a busy lock where the
--            caller would park, and changes nothing (the caller first gives back the
--            locks of its other calls); "only" parks at the lock and takes nothing: a
--            lock nobody holds goes to the first in line, maybe the caller's own
--            ticket; "" otherwise
-- ARGV[14] -> with a ticket, MaxLine's n: a caller with no entry in the line is
--            refused ({-5, pttl, i}) when the line holds n entries or more; "0" or
--            absent for no cap
-- ARGV[15] -> with ARGV[14], "1" to make room instead by taking the oldest parked
--            entry out of the line (full, line.lua); refused when there is none
--
-- A lock and its queue share a hash tag, so one Redis Cluster slot; several locks are
-- in several slots, so in Redis Cluster the caller sends one lock per call.
-- Returns {fence 1, ..., fence n} when all locks are ours; {0, pttl, i} when lock i
-- is the first that another token holds (pttl is -1 when the key has no expiry);
-- {-1, 0, i} when lock i is a lock with Limit(n) (a hash, see slots.lua); {-2, pttl,
-- i} when the caller parked at lock i; {-4, pttl, i} when it would have (ARGV[13]
-- "ask"); {-5, pttl, i} when lock i's line was full (ARGV[14]) and nothing changed
-- there. With ARGV[13] "ask", fences are followed by a 0 when a lock was claimed
-- (handed to the ticket); so is a busy reply ({0, pttl, i} or {-2, pttl, i}) by a 1
-- when the call claimed a lock before lock i, whatever ARGV[13]. Any of these is followed by the tickets of parked tasks a
-- hand-over asks the caller to start, as handOver (plain.lua) gives them.
--
-- Several locks with a ticket: a parked task holds nothing. The caller takes the
-- locks in order, claiming those handed to its ticket; at the first busy one it
-- either waits there, keeping the locks before it, or parks there: then it gives
-- back, in the same call, every other lock it holds or that was handed to its
-- ticket, each to its own line's next as a release does (letGo, plain.lua), and
-- leaves their lines. Waiting or parked, it gives back the locks after the busy one
-- that were handed to its ticket, and leaves their lines, so that it never holds a
-- lock after one it waits for. One that claimed a lock handed to its ticket waits,
-- under "lead", rather than parks (see claimed).
--
-- A parked task (layout.go) that arrives finding the lock handed to its ticket takes
-- it under its own identity, with the fence of the hand-over: nobody held it between.
-- One that finds it busy keeps its entry's place: a started entry becomes its
-- waiter's entry (it waits in a worker, handed the lock as waiters are); a parked one
-- stays parked unless nobody else waits (then it waits, in that place). Parked
-- entries are found by their ticket, reading the whole queue: a park costs time in
-- Redis in proportion to the line.
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
  keepQueue(q, 2 * math.max(pttl, 1000) + 1000)
  if string.byte(v, STATE_AT) == HELD then
    redis.call('SET', lock, withState(v, WAITED), 'KEEPTTL')
  end
end

-- claimed is set once this call claimed a lock handed to the ticket: the task's turn
-- came at that lock. Under "lead" it then waits at a later busy lock, keeping the
-- locks before it, rather than give its turn back and park: tasks whose turn came
-- at one key each would otherwise hand their keys round and round, each giving its
-- own back for another's that is on its way to its task, and none would run.
local claimed = false

-- line puts the caller in the line of lock (queue q), held by another with value v
-- and pttl ms left: as a waiter (entry e), or parked when it has a ticket; nobody
-- without an entry. It returns what take does: 0 (busy) or -2 (parked), and pttl.
local function line(lock, q, v, e, pttl, ticket, start, i)
  if e and ticket then
    local mode = ARGV[12]
    if claimed and mode == 'lead' then
      mode = 'wait'
    end
    if ARGV[13] == 'ask' and not waits(mode, place(q, e, ticket)) then
      return -4, pttl
    end
    local r = 0
    local p = park(q, e, pttl, ticket, ARGV[10], parkedId(ticket) .. ARGV[11], mode, start, i, tonumber(ARGV[14]), ARGV[15] == '1')
    if p == 'full' then
      return -5, pttl
    elseif p == 'parked' then
      r = -2
    end
    if string.byte(v, STATE_AT) == HELD then
      redis.call('SET', lock, withState(v, WAITED), 'KEEPTTL') -- its release looks at the line
    end
    return r, pttl
  elseif e then
    enqueue(lock, q, v, e, pttl)
  end
  return 0, pttl
end

-- parkOnly parks the caller (entry e, ticket) in the line of lock (queue q), whose
-- value is v, taking nothing (ARGV[13] "only"): a lock it holds is given back, a lock
-- handed to its ticket stays so, and a lock nobody holds goes to the first in line,
-- as a release would give them, after the caller took its place; that may be the
-- caller's own ticket, then named to start. In mode "lead" (ARGV[12]) the head is
-- started ahead when nobody else waits, as park starts it. It returns what take
-- does: -2, pttl.
local function parkOnly(lock, q, v, id, e, ticket, start, i)
  local pttl = redis.call('PTTL', lock)
  if v and held(v) and ours(v, parkedId(ticket)) then
    -- Handed to the ticket already (by this call sent before, its reply lost, or by a
    -- release since): its turn has come. It is named to start again, as not started
    -- yet, since its task is still returning from its park.
    redis.call('LREM', q, 0, e)
    start[#start + 1] = i .. ' ' .. PARKED .. ticket
    return -2, pttl
  end
  local _, _, _, waiting = place(q, e, ticket)
  park(q, e, pttl, ticket, ARGV[10], parkedId(ticket) .. ARGV[11], 'park', start, i)
  if ARGV[12] == 'lead' and not waiting then
    prestart(q, start, i) -- as park does for a lead: nobody is on the way, the head goes
  end
  if v and held(v) then
    if ours(v, id) then -- to the line, which holds the caller now
      letGo(lock, q, withState(v, WAITED), id, ARGV[7], ARGV[8], start, i, TOMBSTONE_MILLIS)
    elseif string.byte(v, STATE_AT) == HELD then
      redis.call('SET', lock, withState(v, WAITED), 'KEEPTTL') -- its release looks at the line
    end
  else
    markReleased(lock, v)
    serve(lock, q, v, previous(v), ARGV[7], ARGV[8], nil, nil, start, i)
  end
  return -2, redis.call('PTTL', lock)
end

-- take takes lock (queue q) or queues the waiter (head, its entry's head; "" for
-- none), or parks it (ARGV[9..15]); it returns the fence (0: busy, -1: a lock with
-- Limit(n) holds the key, -2: parked, -4: would park, -5: its line is full) and the
-- remaining lease of the holder.
local function take(lock, q, id, ttl, head, queued, desc, start, i)
  local v = redis.pcall('GET', lock)
  if type(v) == 'table' then -- an error: a lock with Limit(n), a hash, holds the key
    return -1, 0
  end
  local e = nil
  if head ~= '' then
    e = head .. ' ' .. id .. desc
  end
  local ticket = nil
  if ARGV[9] ~= '' then
    ticket = ARGV[9]
  end
  if e and ticket and ARGV[13] == 'only' then
    return parkOnly(lock, q, v, id, e, ticket, start, i)
  end
  if v and held(v) then
    if ours(v, id) then
      redis.call('PEXPIRE', lock, ttl)
      if queued == '1' then
        redis.call('LREM', q, 0, e)
      end
      return fenceOf(v), 0
    end
    if ticket and ours(v, parkedId(ticket)) then
      -- Handed to our ticket: ours now, under our own identity and lease.
      -- Since the hand-over, which is when the lock became its.
      claimed = true
      local _, prev = holder(v)
      local f = fenceOf(v)
      redis.call('SET', lock, value(f, string.byte(v, STATE_AT), tonumber(string.sub(v, SINCE_AT, ID_AT - 1)), id .. desc, prev), 'PX', ttl)
      return f, 0
    end
    return line(lock, q, v, e, redis.call('PTTL', lock), ticket, start, i)
  end
  -- Free: absent, or a tombstone, which goes now.
  markReleased(lock, v)
  local prev = previous(v)
  local served, last = serve(lock, q, v, prev, ARGV[7], ARGV[8], e, ticket, start, i)
  if served == 'other' then
    return line(lock, q, redis.call('GET', lock), e, redis.call('PTTL', lock), ticket, start, i)
  end
  local state = HELD
  if served == 'self' then
    state = WAITED -- others may be queued behind us
    prestart(q, start, i)
  end
  local f, now = nextFence(last)
  redis.call('SET', lock, value(f, state, now, id .. desc, prev), 'PX', ttl)
  return f, 0
end

local n = #KEYS / 2
local start = {}
local function reply(r)
  return withTickets(r, start)
end

local ticket = nil -- of a task that may park (ARGV[9])
if ARGV[9] ~= '' then
  ticket = ARGV[9]
end

-- handedToTicket reports whether value v is a lock handed to the ticket.
local function handedToTicket(v)
  return ticket ~= nil and ours(v, parkedId(ticket))
end

-- leave takes the caller out of the line of lock j (its waiter entry e, if any, and
-- its ticket's parked entries) and gives the lock back if the caller holds it or it
-- was handed to the ticket: to its line's next, as a release does (letGo).
local function leave(j, e)
  local lock, q = KEYS[2 * j - 1], KEYS[2 * j]
  if e then
    redis.call('LREM', q, 0, e)
  end
  unpark(q, ticket)
  local v = redis.pcall('GET', lock)
  if type(v) ~= 'string' or not held(v) then
    return
  end
  local r = nil
  if ours(v, ARGV[1]) then
    r = ARGV[1]
  elseif handedToTicket(v) then
    r = parkedId(ticket)
  end
  if r then
    letGo(lock, q, v, r, ARGV[7], ARGV[8], start, j, TOMBSTONE_MILLIS)
  end
end

if ARGV[6] == '1' and n > 1 then
  -- All or none: find a busy lock before taking any. A free lock with listening
  -- waiters is busy: it goes to them.
  for i = 1, n do
    local lock, q = KEYS[2 * i - 1], KEYS[2 * i]
    local v = redis.pcall('GET', lock)
    if type(v) == 'table' then
      return reply({-1, 0, i})
    end
    if v and held(v) then
      if not ours(v, ARGV[1]) and not handedToTicket(v) then
        return reply({0, redis.call('PTTL', lock), i})
      end
    elseif serve(lock, q, v, previous(v), ARGV[7], ARGV[8], nil, nil, start, i) == 'other' then
      markReleased(lock, v)
      return reply({0, redis.call('PTTL', lock), i})
    end
  end
end
local fences = {}
for i = 1, n do
  local f, pttl = take(KEYS[2 * i - 1], KEYS[2 * i], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], start, i)
  if f <= 0 then
    if ticket and ARGV[3] ~= '' and (f == 0 or f == -2) then
      -- A parked task holds nothing; a waiting one nothing after the lock it waits for.
      local e = ARGV[3] .. ' ' .. ARGV[1] .. ARGV[5]
      for j = 1, n do
        if j > i or (f == -2 and j < i) then
          leave(j, e)
        end
      end
    end
    if claimed then
      return reply({f, pttl, i, 1}) -- its turn came: see claimed; the next attempt does not know it
    end
    return reply({f, pttl, i})
  end
  fences[i] = f
end
if claimed and ARGV[13] == 'ask' then
  fences[n + 1] = 0 -- tells the caller, whose next calls do not know it
end
return reply(fences)
