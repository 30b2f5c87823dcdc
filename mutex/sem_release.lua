-- sem_release.lua: give up the slot our identity holds in a lock with Limit(n) (see
-- semaphore.lua), handing it to the oldest waiter whose client is listening.
--
-- KEYS[1] -> <prefix>{<key>}                    the holders (a HASH, see semaphore.lua)
-- KEYS[2] -> <prefix>{<key>}:wait               waiters, as in lock.lua
-- KEYS[3] -> <prefix>{<key>}:released:<digest>  set for a while when this identity
--                                               released: the digest is of the identity
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
-- ARGV[2] -> a waiter that gives up, to take out of the queue first (its entry as
--            sem_lock.lua wrote it), or "" for a plain release
-- ARGV[3] -> channel prefix, as in release.lua
-- ARGV[4] -> "1" when PUBLISH counts every subscriber, as in release.lua
-- ARGV[5] -> how long KEYS[3] stays, and the tombstone of the last release, in ms
--
-- Returns 1 when released, 0 when our identity holds no slot (its lease ended, or
-- it never had one). A release repeated after a lost reply finds KEYS[3] and
-- returns 1 again, changing nothing.
if ARGV[2] ~= '' then
  redis.call('LREM', KEYS[2], 1, ARGV[2])
end
local us, ms = semNow()
if semType(KEYS[1]) == 'hash' then
  local s = semLoad(KEYS[1], ms, '')
  local released = s.held['h' .. ARGV[1]] ~= nil
  local by = '0000'
  if released then
    redis.call('HDEL', KEYS[1], 'h' .. ARGV[1])
    s.held['h' .. ARGV[1]] = nil
    s.live = s.live - 1
    by = ARGV[1]
    redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
  end
  -- Slots freed by this release and by leases that ended go to the waiters.
  semHandOver(KEYS[1], KEYS[2], s, '', '', '', 0, ARGV[3], ARGV[4], us, ms)
  semStore(KEYS[1], s, by, us, ms, ARGV[5])
  if released then
    return 1
  end
end
if redis.call('GET', KEYS[3]) then
  return 1
end
return 0
