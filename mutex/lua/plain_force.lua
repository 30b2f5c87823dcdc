-- plain_force.lua: release the lock whoever holds it, for an operator freeing a
-- stuck key.
--
-- KEYS[1] -> <prefix>{<key>}        the lock (layout.go)
-- KEYS[2] -> <prefix>{<key>}:wait   its waiters, oldest first (layout.go)
-- ARGV[1] -> identity the release is made under: a fresh token no holder has
-- ARGV[2] -> channel prefix, as in plain_release.lua
-- ARGV[3] -> "1" when PUBLISH counts every subscriber, as in plain_release.lua
-- ARGV[4] -> how long the tombstone stays, in milliseconds
--
-- Returns, read before anything changed, {value or false, pttl, length of the queue,
-- {}, server time}, as inspect.lua does for a plain lock, followed by the value after
-- when the lock was handed to a waiter (false otherwise), and: 0; 1 when this release
-- was applied before (a repeat after a lost reply: then nothing changes, and the rest
-- says nothing of the old holder); 2 when the key is a lock with Limit(n) (a hash:
-- nothing changes, and the rest says nothing). When nobody held the lock nothing
-- changes.
--
-- Afterwards the old holder's token holds nothing: its Extend finds another identity
-- and fails, its Unlock returns 2 (see plain_release.lua), and every later holder's
-- fence is higher than its own. The mark FORCED .. old identity .. ARGV[1] that the
-- next value carries as its previous holder (kept by the holders after, see
-- plain_lock.lua) tells the old holder's release what happened, and a repeat of this
-- call that it was applied.
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then
  return {false, 0, 0, {}, redis.call('TIME'), false, 2}
end
if v then
  local id, p = holder(v)
  if id == ARGV[1] or (string.byte(p, 1) == FORCED and string.sub(p, -#ARGV[1]) == ARGV[1]) then
    return {false, 0, 0, {}, redis.call('TIME'), false, 1}
  end
end
local before = {v, redis.call('PTTL', KEYS[1]), redis.call('LLEN', KEYS[2]), {}, redis.call('TIME'), false, 0}
if not v or not held(v) then
  return before
end
local state = string.byte(v, STATE_AT)
if #v < ID_AT - 1 + LEN_DIGITS or (state ~= HELD and state ~= WAITED) then -- not of our form: set by hand
  redis.call('DEL', KEYS[1])
  return before
end
-- The next value names the old holder, marked, as the previous one: its release
-- then learns that it was released by force (see plain_release.lua).
local old = string.char(FORCED) .. holder(v) .. ARGV[1]
local last = v
if state == WAITED then
  local given
  given, last = handOver(KEYS[1], KEYS[2], v, old, ARGV[2], ARGV[3], nil, nil, nil, 1)
  if given then
    before[6] = redis.call('GET', KEYS[1])
    return before
  end
end
redis.call('SET', KEYS[1], tombstone(last, ARGV[1], old), 'PX', ARGV[4])
return before
