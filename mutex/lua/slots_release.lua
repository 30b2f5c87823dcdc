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
-- ARGV[7] -> a ticket whose parked entries (layout.go) to take out of the queue
--            first, or "": with ARGV[1] its parked identity, this releases a slot
--            handed to a parked task that will not come (see Starter)
--
-- Returns {1} when released, {0} when our identity holds no slot (its lease ended,
-- or it never had one), followed by the tickets of parked tasks the hand-over asks
-- the caller to start (slotsHandOver, slots.lua). KEYS[3] holds "<fence>", then
-- " <mark><ticket>" for each of those tickets. A release repeated after a lost reply
-- finds KEYS[3] holding its fence and returns {1} again, changing nothing but naming
-- again the tickets it asked to start whose task has not claimed its slot yet, and
-- the head of the queue if it was started ahead (starting twice is harmless); a mark
-- of another slot (the token used again) does not count. Queue entries of our identity (left by a lost reply's
-- resend) are dropped, not handed the slot we give up.
if ARGV[2] ~= '' then
  redis.call('LREM', KEYS[2], 0, ARGV[2])
end
if ARGV[7] ~= '' then
  unpark(KEYS[2], ARGV[7])
end
local start = {}
local function reply(r)
  return withTickets(r, start)
end
local c = slotsCall(KEYS[1], KEYS[2], ARGV[3], ARGV[4])
local live = {}
if keyType(KEYS[1]) == 'hash' then
  local s = slotsLoad(c, SLOT_HOLDER .. ARGV[1])
  local released = s.mine ~= nil
  local by = NO_DESCRIPTION
  if released then
    redis.call('HDEL', KEYS[1], SLOT_HOLDER .. ARGV[1])
    s.live = s.live - 1 -- s.held keeps us, so that no entry of ours gets the slot
    by = ARGV[1]
  end
  -- Slots freed by this release and by leases that ended go to the line.
  slotsHandOver(c, s, nil, start)
  slotsStore(c, s, by, ARGV[5])
  if released then
    local mark = string.match(s.mine, '^%d+ (%d+)')
    for _, x in ipairs(start) do
      mark = mark .. ' ' .. string.sub(x, 3) -- "1 <mark><ticket>"
    end
    redis.call('SET', KEYS[3], mark, 'PX', ARGV[5])
    return reply({1})
  end
  live = s.held
end
local mark = redis.call('GET', KEYS[3])
local fence = mark and string.match(mark, '^%d+')
if fence and (ARGV[6] == '0' or fence == ARGV[6]) then
  -- A repeat: name again the tickets whose slots are still theirs to claim.
  for t in string.gmatch(string.sub(mark, #fence + 1), '%S+') do
    t = string.sub(t, 2)
    if live[SLOT_HOLDER .. parkedId(t)] then
      start[#start + 1] = '1 ' .. STARTED .. t
    end
  end
  restartHead(KEYS[2], start, 1)
  return reply({1})
end
return reply({0})
