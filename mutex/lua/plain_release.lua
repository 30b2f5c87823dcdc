-- plain_release.lua: release the locks our token holds, handing each to the oldest
-- waiter whose client is listening.
--
-- KEYS[3i-2] -> <prefix>{<key i>}                     lock i (layout.go)
-- KEYS[3i-1] -> <prefix>{<key i>}:wait                its waiters, oldest first (layout.go)
-- KEYS[3i]   -> <prefix>{<key i>}:released:<digest>   the mark of this identity's
--                                                     release (layout.go): set when it
--                                                     hands the lock over here, or by
--                                                     the next holder that takes its
--                                                     tombstone (markReleased)
-- One lock, or several held as one (in Redis Cluster the caller sends one per call).
-- ARGV[1] -> identity of the holder
-- ARGV[2] -> a waiter that gives up, to take out of every queue first (its entry as
--            plain_lock.lua wrote it), or "" for a plain release
-- ARGV[3] -> channel prefix: a client <c> listens on ARGV[3] .. <c>
-- ARGV[4] -> "1" when PUBLISH counts every subscriber (not in Redis Cluster, where it
--            counts those of this node only)
-- ARGV[5] -> how long the tombstone and the mark of a release stay, in milliseconds
-- ARGV[6] -> the fence of the lock to release, or "0" when not known (several locks)
-- ARGV[7] -> a ticket whose parked entries (layout.go) to take out of every queue
--            first, or "": with ARGV[1] its parked identity, this releases a lock
--            handed to a parked task that will not come (see Starter)
--
-- For each lock: 1 when released, 0 when the key is gone or holds another token, 2
-- when our lock was released by force (plain_force.lua) since; in both of the latter
-- cases the lock is not touched. Returns {2} if any lock gave 2, else {0} if any gave
-- 0, else {1}, followed by the tickets of parked tasks the hand-overs ask the caller
-- to start (handOver, plain.lua).
--
-- A release that finds its own tombstone, or its mark (however often the lock
-- changed hands since, to a plain lock or one with Limit(n)), or the lock handed over
-- by itself (the previous holder), counts as released: it was applied already and
-- its reply lost. The lock goes to the
-- oldest listening waiter (handOver, plain.lua); when nobody is left, it becomes a
-- tombstone.

-- released reports whether this identity's mark says it released the lock with the
-- fence asked about (any, when "0").
local function released(mark)
  if ARGV[2] ~= '' then
    return false -- a waiter giving up held nothing to hand over
  end
  local f = redis.call('GET', mark)
  return f ~= false and (ARGV[6] == '0' or tonumber(f) == tonumber(ARGV[6]))
end

local start = {}

-- restart adds to start, again, the tickets a hand-over of value v asked to start:
-- the parked task v is handed to, and the one at the head of queue q started ahead.
local function restart(q, v, i)
  local who = holder(v)
  local n = tonumber(string.sub(who, 1, LEN_DIGITS)) or 0
  if string.sub(who, LEN_DIGITS + 1, LEN_DIGITS + 1) == PARKED and n > 1 then
    start[#start + 1] = i .. ' ' .. STARTED .. string.sub(who, LEN_DIGITS + 2)
  end
  restartHead(q, start, i)
end

local function release(lock, q, mark, i)
  if ARGV[2] ~= '' then
    redis.call('LREM', q, 0, ARGV[2])
  end
  if ARGV[7] ~= '' then
    unpark(q, ARGV[7])
  end
  local v = redis.pcall('GET', lock)
  if type(v) == 'table' then -- a lock with Limit(n), a hash, took the key after us?
    return released(mark) and 1 or 0
  end
  if not v then
    return released(mark) and 1 or 0
  end
  if not ours(v, ARGV[1]) then
    local _, prev = holder(v)
    if string.sub(prev, 1, #ARGV[1] + 1) == string.char(FORCED) .. ARGV[1] then
      return 2
    end
    if ARGV[2] == '' and held(v) and prev == ARGV[1] then
      -- Handed over by this release, whose reply was lost: name again the tickets it
      -- asked to start (starting twice is harmless).
      restart(q, v, i)
      return 1
    end
    if released(mark) then
      return 1
    end
    return 0
  end
  local state = string.byte(v, STATE_AT)
  if state == RELEASED then
    return 1
  end
  if letGo(lock, q, v, ARGV[1], ARGV[3], ARGV[4], start, i, ARGV[5]) then
    redis.call('SET', mark, string.sub(v, 1, FENCE_DIGITS), 'PX', ARGV[5])
  end
  return 1
end

local res = 1
for i = 1, #KEYS / 3 do
  local r = release(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], i)
  if r == 2 or (r == 0 and res == 1) then
    res = r
  end
end
local reply = {res}
for _, t in ipairs(start) do
  reply[#reply + 1] = t
end
return reply
