-- slots_free.lua: for a plain lock's attempt, or a release by force, that found a
-- lock with Limit(n) (see slots.lua): drop its holders whose lease has ended and,
-- when none is left, hand its freed slots to its waiters or, with no waiter either,
-- make the key a plain lock's tombstone, free to the plain lock.
--
-- KEYS[1] -> <prefix>{<key>}        the holders (a HASH, layout.go)
-- KEYS[2] -> <prefix>{<key>}:slots  waiters, as in slots_lock.lua
-- ARGV[1] -> channel prefix, as in plain_release.lua
-- ARGV[2] -> "1" when PUBLISH counts every subscriber, as in plain_release.lua
-- ARGV[3] -> how long the tombstone stays, in milliseconds
-- ARGV[4] -> "1" when the caller starts the parked tasks handed a slot (an attempt
--            with a Starter); otherwise (a release by force) they are handed slots
--            but come by their own fallback, and nobody is started ahead
--
-- Returns {holders, limit} of the lock as it is left: {0, 0} when the key is free
-- for a plain lock (or was a plain lock's); {-1, 0} when it holds another type.
-- Either is followed, with ARGV[4] "1", by the tickets of parked tasks the hand-over
-- asks the caller to start (slotsHandOver, slots.lua).
local t = keyType(KEYS[1])
if t == 'string' or t == 'none' then
  return {0, 0}
elseif t ~= 'hash' then
  return {-1, 0}
end
local c = slotsCall(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
local s = slotsLoad(c, '')
local r = {s.live, s.limit}
slotsHandOver(c, s, nil, ARGV[4] == '1' and r or nil)
slotsStore(c, s, NO_DESCRIPTION, ARGV[3])
if s.live == 0 then
  r[1], r[2] = 0, 0
else
  r[1], r[2] = s.live, s.limit
end
return r
