-- sem_free.lua: for a plain lock's attempt that found a lock with Limit(n) (see
-- semaphore.lua): drop its holders whose lease has ended and, when none is left,
-- hand the lock's freed slots to its waiters or, with no waiter either, make the key a
-- plain lock's tombstone, free to the plain lock.
--
-- KEYS[1] -> <prefix>{<key>}        the holders (a HASH, see semaphore.lua)
-- KEYS[2] -> <prefix>{<key>}:slots  waiters, as in lock.lua but with "<lease ms>/<limit>"
-- ARGV[1] -> channel prefix, as in release.lua
-- ARGV[2] -> "1" when PUBLISH counts every subscriber, as in release.lua
-- ARGV[3] -> how long the tombstone stays, in milliseconds
--
-- Returns {holders, limit} of the lock as it is left: {0, 0} when the key is free
-- for a plain lock (or was no hash).
if semType(KEYS[1]) ~= 'hash' then
  return {0, 0}
end
local us, ms = semNow()
local s = semLoad(KEYS[1], ms, '')
semHandOver(KEYS[1], KEYS[2], s, '', '', '', 0, ARGV[1], ARGV[2], us, ms)
semStore(KEYS[1], s, '0000', us, ms, ARGV[3])
if s.live == 0 then
  return {0, 0}
end
return {s.live, s.limit}
