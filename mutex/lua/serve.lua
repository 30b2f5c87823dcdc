-- serve.lua: serve the line of a key whose holder's lease has run out, taking
-- nothing: what the next attempt to take the key would do for its line
-- (plain_lock.lua, slots_lock.lua), for a caller that looks when a lease ends, where
-- nobody else may (every task of the key parked, see Client.Serve).
--
-- KEYS[1] -> <prefix>{<key>}          the lock: a plain lock's string, or the hash of a
--                                     lock with Limit(n) (layout.go)
-- KEYS[2] -> <prefix>{<key>}:wait     a plain lock's line
-- KEYS[3] -> <prefix>{<key>}:slots    the line of a lock with Limit(n)
-- ARGV[1] -> n, the limit the key is taken with (1: a plain lock): it says which line
--            to serve while nobody holds the key, and becomes the limit of a hash
--            nobody holds, as in slots_lock.lua; with 1, a hash is served with its
--            own limit, as slots_free.lua does
-- ARGV[2] -> channel prefix, as in plain_release.lua
-- ARGV[3] -> "1" when PUBLISH counts every subscriber, as in plain_release.lua
-- ARGV[4] -> how long the tombstone of a lock with Limit(n) that nobody holds any more
--            stays, in milliseconds
--
-- All three keys share the hash tag, so one Redis Cluster slot.
-- Returns {left, waiting, line}, then the tickets of the parked tasks the hand-over
-- asks the caller to start, as handOver (plain.lua) and slotsHandOver (slots.lua)
-- give them ("1 <mark><ticket>"). left is the lease left, in ms, of the key's holder
-- after the call (the one it handed the key to, if any): -1 when the key has no
-- expiry; for Limit(n), the soonest lease end of its holders when all n slots are
-- held, and 0 when one is free; 0 when the key is free. waiting is 1 when the line
-- still holds an entry, parked or waiting, else 0; line is 1 for a plain lock's line,
-- 2 for the slots' line. {-3, 0, 2} when the key holds another type.
--
-- A key that is held changes nothing, nor does a free key whose line is empty. A
-- plain lock held by someone else, with Limit(n) asked, answers its lease left and
-- whether either line holds anyone.
local n = tonumber(ARGV[1])
local start = {}
local function reply(r)
  return withTickets(r, start)
end
local function inLine(q)
  return redis.call('LINDEX', q, 0) and 1 or 0
end
local lock = KEYS[1]
local v = redis.pcall('GET', lock) -- an error: a hash holds the key (Limit(n))
local plain = type(v) ~= 'table'
if plain and v and held(v) then
  local w = inLine(KEYS[2])
  if n > 1 then
    w = math.max(w, inLine(KEYS[3]))
  end
  return {redis.call('PTTL', lock), w, 1}
end
if plain and n <= 1 then
  -- A plain lock nobody holds: its line goes first, as in plain_lock.lua.
  local served = serve(lock, KEYS[2], v, previous(v), ARGV[2], ARGV[3], nil, nil, start, 1)
  local left = 0
  if served == 'other' then
    markReleased(lock, v)
    left = redis.call('PTTL', lock)
  end
  return reply({left, inLine(KEYS[2]), 1})
end
if plain and inLine(KEYS[3]) == 0 then
  return {0, 0, 2} -- free, and nobody in the slots' line
end
-- A lock with Limit(n): slots freed by leases that ended go to the line, as in
-- slots_lock.lua.
local c = slotsCall(lock, KEYS[3], ARGV[2], ARGV[3])
local s, refused = slotsOpen(c, n > 1 and n or 0, '')
if not s then
  return {refused[1], 0, 2}
end
slotsHandOver(c, s, nil, start)
slotsStore(c, s, NO_DESCRIPTION, ARGV[4])
local left = 0
if s.live > 0 and s.live >= s.limit then
  left = math.max(s.first - c.ms, 1)
end
return reply({left, inLine(KEYS[3]), 2})
