-- inspect.lua: read a lock of either kind and its waiters, changing nothing.
--
-- KEYS[1] -> <prefix>{<key>}         the lock: a plain lock's string, or the hash of a
--                                    lock with Limit(n) (layout.go)
-- KEYS[2] -> <prefix>{<key>}:wait    a plain lock's waiters
-- KEYS[3] -> <prefix>{<key>}:slots   the waiters of a lock with Limit(n)
-- ARGV[1] -> how many waiters to return, oldest first
-- ARGV[2] -> "1" to count the parked entries of the queue
--
-- Returns {type, value, pttl of the lock, length of the queue, the first ARGV[1]
-- entries of the queue, server time {seconds, microseconds}, parked, oldest}: for a
-- plain lock (type "string", or "none" when the key is absent) the value or false,
-- and its queue; for a lock with Limit(n) ("hash") its fields and values (HGETALL),
-- holders whose lease has ended included (the reader compares their lease end with
-- the server time), and its queue; for a key of another type, its type and nothing
-- else. A key nobody holds (absent, or a tombstone) whose plain queue is empty shows
-- the queue of a lock with Limit(n) instead, if that has entries: its line outlives
-- its holders (a slot handed to a parked task whose claim ended). parked is how many
-- entries of the queue are parked ones (layout.go), started or not, and oldest the
-- earliest time one of them parked (server ms), or false when none is (or ARGV[2] is
-- not "1").
--
-- Counting reads the whole queue, CHUNK entries per LRANGE so that no more than that
-- many are held at once: time in Redis in proportion to the line (for List, per key),
-- as every park spends already (plain_lock.lua), and memory of one chunk.
local CHUNK = 1000
local t = keyType(KEYS[1])
local v, q = false, KEYS[2]
if t == 'string' then
  v = redis.call('GET', KEYS[1])
elseif t == 'hash' then
  v, q = redis.call('HGETALL', KEYS[1]), KEYS[3]
elseif t ~= 'none' then
  return {t, false, 0, 0, {}, redis.call('TIME'), 0, false}
end
if t ~= 'hash' and (not v or not held(v)) and redis.call('LLEN', q) == 0 then
  q = KEYS[3]
end
local n = tonumber(ARGV[1])
local w = {}
if n > 0 then
  w = redis.call('LRANGE', q, 0, n - 1)
end
local len = redis.call('LLEN', q)
local parked, oldest = 0, false
if ARGV[2] == '1' then
  for from = 0, len - 1, CHUNK do
    for _, e in ipairs(redis.call('LRANGE', q, from, from + CHUNK - 1)) do
      local m = string.sub(e, 1, 1)
      if (m == PARKED or m == STARTED) and string.sub(e, 2, 2) == '.' then
        parked = parked + 1
        -- "<mark>.<ticket> <claim> <since> ...": the ticket has no space.
        local since = tonumber(string.match(e, '^%S+ %S+ (%d+) '))
        if since and (not oldest or since < oldest) then
          oldest = since
        end
      end
    end
  end
end
return {t, v, redis.call('PTTL', KEYS[1]), len, w, redis.call('TIME'), parked, oldest}
