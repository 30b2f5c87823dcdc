-- slots_release.lua: give up the slot our identity holds in a lock with Limit(n) (see
-- slots.lua), handing it to the oldest waiter whose client is listening.
--
-- KEYS[1] -> <prefix>{<key>}                    the holders (a HASH, layout.go)
-- KEYS[2] -> <prefix>{<key>}:slots              waiters (see slots_lock.lua)
-- KEYS[3] -> <prefix>{<key>}:released:<digest>  set for a while when this identity
--                                               released, to the fence of the slot it
--                                               released (layout.go)
-- ARGV[1] -> identity of the holder
-- ARGV[2] -> a waiter that gives up, to take out of the queue first (its entry as
--            slots_lock.lua wrote it), or "" for a plain release
-- ARGV[3] -> channel prefix, as in plain_release.lua
-- ARGV[4] -> "1" when PUBLISH counts every subscriber, as in plain_release.lua
-- ARGV[5] -> how long KEYS[3] stays, and the tombstone of the last release, in ms
-- ARGV[6] -> the fence of the slot to release, or "0" when not known
--
-- Returns 1 when released, 0 when our identity holds no slot (its lease ended, or
-- it never had one). A release repeated after a lost reply finds KEYS[3] holding its
-- fence and returns 1 again, changing nothing; a mark of another slot (the token
-- used again) does not count. Queue entries of our identity (left by a lost reply's
-- resend) are dropped, not handed the slot we give up.
if ARGV[2] ~= '' then
  redis.call('LREM', KEYS[2], 0, ARGV[2])
end
local c = slotsCall(KEYS[1], KEYS[2], ARGV[3], ARGV[4])
if keyType(KEYS[1]) == 'hash' then
  local s = slotsLoad(c, SLOT_HOLDER .. ARGV[1])
  local released = s.mine ~= nil
  local by = NO_DESCRIPTION
  if released then
    redis.call('HDEL', KEYS[1], SLOT_HOLDER .. ARGV[1])
    s.live = s.live - 1 -- s.held keeps us, so that no entry of ours gets the slot
    by = ARGV[1]
    redis.call('SET', KEYS[3], string.match(s.mine, '^%d+ (%d+)'), 'PX', ARGV[5])
  end
  -- Slots freed by this release and by leases that ended go to the waiters.
  slotsHandOver(c, s, nil)
  slotsStore(c, s, by, ARGV[5])
  if released then
    return 1
  end
end
local mark = redis.call('GET', KEYS[3])
if mark and (ARGV[6] == '0' or mark == ARGV[6]) then
  return 1
end
return 0
