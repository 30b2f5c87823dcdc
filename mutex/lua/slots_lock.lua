-- slots_lock.lua: take a slot of a lock with Limit(n) (see slots.lua), or confirm
-- that our identity holds one; when all n are taken, queue the caller as a waiter.
--
-- KEYS[1] -> <prefix>{<key>}        the holders (a HASH, layout.go); expires with the longest lease
-- KEYS[2] -> <prefix>{<key>}:slots  waiters, as in plain_lock.lua but with "<lease ms>/<limit>"
-- ARGV[1] -> identity of this acquisition
-- ARGV[2] -> lease in milliseconds
-- ARGV[3] -> head of the waiter's queue entry, to queue it if every slot is taken
--            ("<client>.<waiter> <lease ms>/<limit>"), or ""
-- ARGV[4] -> "1" if an earlier attempt of this waiter may have queued it
-- ARGV[5] -> the holder's description, counted
-- ARGV[6] -> n, the limit asked for
-- ARGV[7] -> channel prefix, as in plain_release.lua
-- ARGV[8] -> "1" when PUBLISH counts every subscriber, as in plain_release.lua
-- ARGV[9..12] -> the ticket of a task that may park in the line, its claim, the
--            description of its task and what the caller does when every slot is
--            taken, as in plain_lock.lua
-- ARGV[13], ARGV[14] -> MaxLine's n ("0" or absent: no cap) and "1" to replace, as
--            ARGV[14] and ARGV[15] in plain_lock.lua
--
-- Both keys share the hash tag, so one Redis Cluster slot.
-- Returns {fence, 0} when a slot is ours; {0, ms} when all are taken, ms being the
-- time until the earliest lease ends; {-1, m} when holders use another limit m;
-- {-2, pttl} when a plain lock holds the key; {-3, 0} when the key holds another type;
-- {-4, ms} when the caller parked (ms as for {0, ms}); {-5, ms} when the line was
-- full (ARGV[13]) and the caller stands nowhere in it. Any of these is followed by
-- the tickets of parked tasks a hand-over asks the caller to start, as slotsHandOver
-- (slots.lua) gives them.
--
-- Slots freed by leases that ended go first to the queue, oldest first (our own entry
-- takes its turn there); a slot left over goes to the caller. A waiter keeps its
-- place while it retries, as in plain_lock.lua. When nobody holds the key, the limit
-- asked for becomes the key's.
--
-- Parked tasks share the queue with the waiters, as in a plain lock's line
-- (plain_lock.lua): one that arrives finding a slot handed to its ticket (held by its
-- parked identity) takes it under its own identity and lease, with the fence and
-- since of the hand-over; one that finds every slot taken keeps its entry's place
-- (park, line.lua); a slot left free goes to the oldest entry, parked or waiting.
local n = tonumber(ARGV[6])
local c = slotsCall(KEYS[1], KEYS[2], ARGV[7], ARGV[8])
local start = {}
local function reply(r)
  return withTickets(r, start)
end
local s, refused = slotsOpen(c, n, SLOT_HOLDER .. ARGV[1])
if not s then
  return refused
end
if s.live > 0 and s.limit ~= n then
  return {-1, s.limit}
end
local e = ''
if ARGV[3] ~= '' then
  e = ARGV[3] .. ' ' .. ARGV[1] .. ARGV[5]
end
local ticket = ARGV[9] ~= '' and ARGV[9]
local lease = tonumber(ARGV[2])
local mine = s.mine
local handed = ticket and SLOT_HOLDER .. parkedId(ticket)
if not mine and handed and s.held[handed] then
  -- A slot handed to our ticket: ours now, under our own identity and lease, with
  -- the fence and since of the hand-over, which is when it became its.
  mine = string.match(redis.call('HGET', KEYS[1], handed), '^%d+ %d+ %d+ ') .. ARGV[5]
  redis.call('HDEL', KEYS[1], handed)
  s.held[handed] = nil
  s.held[SLOT_HOLDER .. ARGV[1]] = true
end
if mine then -- ours already (a retry after a lost reply, or a hand-over not heard)
  local ends = c.ms + lease
  redis.call('HSET', KEYS[1], SLOT_HOLDER .. ARGV[1], string.format('%d', ends) .. string.match(mine, '^%d+(.*)$'))
  s.last = math.max(s.last, ends)
  if ARGV[4] == '1' then
    redis.call('LREM', KEYS[2], 0, e)
  end
  slotsHandOver(c, s, nil, start)
  slotsStore(c, s, ARGV[1], 0)
  return reply({tonumber(string.match(mine, '^%d+ (%d+)')), 0})
end
local me = nil
if ARGV[4] == '1' or ticket then
  me = {entry = ARGV[4] == '1' and e, ticket = ticket, id = ARGV[1], desc = ARGV[5], lease = lease}
end
local f = slotsHandOver(c, s, me, start)
if not f and s.live < s.limit then
  f = slotsGrant(c, s, ARGV[1], ARGV[5], lease)
  if ARGV[4] == '1' then
    redis.call('LREM', KEYS[2], 0, e)
  end
end
slotsStore(c, s, ARGV[1], 0)
if f then
  return reply({f, 0})
end
local wait = math.max((s.first or c.ms) - c.ms, 1)
if e ~= '' and ticket then
  local p = park(KEYS[2], e, math.max(s.last - c.ms, 1), ticket, ARGV[10], parkedId(ticket) .. ARGV[11], ARGV[12], start, 1,
    tonumber(ARGV[13]), ARGV[14] == '1')
  if p == 'full' then
    return reply({-5, wait})
  elseif p == 'parked' then
    return reply({-4, wait})
  end
elseif e ~= '' then
  if not redis.call('LPOS', KEYS[2], e) then -- not twice after a lost reply
    redis.call('RPUSH', KEYS[2], e)
  end
  keepQueue(KEYS[2], 2 * math.max(s.last - c.ms, 1000) + 1000)
end
return reply({0, wait})
