-- line.lua: the parked entries of a key's line (layout.go, park.go), shared after
-- common.lua by the scripts of both kinds: a plain lock's queue (<lock>:wait) and the
-- queue of a lock with Limit(n) (<lock>:slots) hold them alike, between the waiters'
-- entries, in the order they came.

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

-- parkedId is the identity a lock (or a slot) holds while it is handed to ticket: as
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
-- be started ahead of its turn: the entry is marked STARTED and "<i> <mark><ticket>"
-- added to start (i, the lock's place in the call), so that the task is on its way
-- while the holders work, and waits for its turn in a worker, to be handed the lock
-- as a waiter is.
local function prestart(q, start, i)
  local h = redis.call('LINDEX', q, 0)
  if h and string.sub(h, 1, 1) == PARKED and string.sub(h, 2, 2) == '.' then
    redis.call('LSET', q, 0, STARTED .. string.sub(h, 2))
    local _, ticket = parkedEntry(h)
    start[#start + 1] = i .. ' ' .. PARKED .. ticket
  end
end

-- restartHead adds to start, again, the ticket of the head of queue q if a hand-over
-- started it ahead (a release repeated after a lost reply names it again).
local function restartHead(q, start, i)
  local h = redis.call('LINDEX', q, 0)
  local mark, t = nil, nil
  if h then
    mark, t = parkedEntry(h)
  end
  if mark == STARTED then
    start[#start + 1] = i .. ' ' .. STARTED .. t
  end
end

-- withTickets appends the tickets of start (parked tasks a call asks its caller to
-- start, see handOver) to reply r, and returns r.
local function withTickets(r, start)
  for _, t in ipairs(start) do
    r[#r + 1] = t
  end
  return r
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

-- unpark takes the entries of ticket out of queue q.
local function unpark(q, ticket)
  for _, x in ipairs(redis.call('LRANGE', q, 0, -1)) do
    local mark, t = parkedEntry(x)
    if mark and t == ticket then
      redis.call('LREM', q, 0, x)
    end
  end
end

-- place reads queue q for the caller (its waiter entry e, its ticket): all the
-- entries; the caller's own, "waiter" or its parked entry's mark, and where (nil
-- when it has none); and whether anyone else waits (a waiter, or a task on its way).
local function place(q, e, ticket)
  local all = redis.call('LRANGE', q, 0, -1)
  local mine, at, waiting = nil, nil, false
  for j, x in ipairs(all) do
    local mark, t = parkedEntry(x)
    if x == e then
      mine, at = 'waiter', j
    elseif mark and t == ticket then
      mine, at = mark, j
    elseif mark ~= PARKED then
      waiting = true -- a waiter, or a task on its way
    end
  end
  return all, mine, at, waiting
end

-- waits reports whether park, in mode, has the caller wait rather than park, given
-- what place read.
local function waits(mode, all, mine, at, waiting)
  if mode == 'park' then
    return false
  elseif mode == 'wait' or mine == STARTED or mine == 'waiter' then
    return true
  end
  return not waiting and (at == 1 or #all == 0) -- lead: the first in a worker, at the head or in an empty line
end

-- full applies MaxLine (cap, replace; cap nil or 0: none) to a caller with no entry
-- in queue q (mine, from place) whose entries all are: when they are cap or more
-- (waiters, parked and started entries), it returns true, and the caller is to be
-- refused; with replace it first makes room: the oldest parked entry (not a started
-- one, not a waiter) leaves q and all, "<i> <REPLACED><ticket>" is added to start
-- for the caller's Starter, and it returns false. Only a line without a parked entry
-- refuses then.
local function full(q, all, mine, cap, replace, start, i)
  if mine or not cap or cap <= 0 or #all < cap then
    return false
  end
  if replace then
    for j, x in ipairs(all) do
      local mark, t = parkedEntry(x)
      if mark == PARKED then
        redis.call('LREM', q, 1, x)
        table.remove(all, j)
        start[#start + 1] = i .. ' ' .. REPLACED .. t
        return false
      end
    end
  end
  return true
end

-- park puts the caller (its waiter entry e, its ticket, claim and who) in queue q,
-- behind holders whose lease has pttl ms left, as mode says (the lock scripts' mode
-- argument: "lead", "wait" or "park"); it returns "parked" or "wait". A caller that
-- waits has its waiter entry e in the line, in its ticket's place if it had one; one
-- that parks has a parked entry, in its place if it had one. The queue then lives
-- past the parked task's own return (its fallback, about a claim later). The caller
-- marks its lock as having a line, if its kind needs that. With cap (MaxLine, see
-- full) it returns "full" instead, and changes nothing, when the line refuses a
-- caller that has no entry yet.
local function park(q, e, pttl, ticket, claim, who, mode, start, i, cap, replace)
  local all, mine, at, waiting = place(q, e, ticket)
  if full(q, all, mine, cap, replace, start, i) then
    return 'full'
  end
  local function parked()
    return PARKED .. '.' .. ticket .. ' ' .. claim .. ' ' .. string.format('%d', math.floor(serverMicros() / 1000)) .. ' ' .. who
  end
  local wait = waits(mode, all, mine, at, waiting)
  if wait then
    if not mine then
      redis.call('RPUSH', q, e)
    elseif mine ~= 'waiter' then
      redis.call('LSET', q, at - 1, e)
    end
  elseif not mine then
    redis.call('RPUSH', q, parked())
  elseif mine ~= PARKED then
    redis.call('LSET', q, at - 1, parked())
  end
  if not wait and mode == 'lead' and not waiting then
    prestart(q, start, i) -- nobody is on the way: the head goes
  end
  -- Every park keeps the line past its own fallback (a claim, its jitter and asynq's
  -- move of due retries, 5s by default), and past twice the holders' lease.
  keepQueue(q, math.max(2 * math.max(pttl, 1000), 3 * tonumber(claim)) + 10000)
  return wait and 'wait' or 'parked'
end
