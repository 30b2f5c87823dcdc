-- take: take a start of a key if it may begin within a window (GCRA).
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> the call's member: "<identity> <interval> <burst>"
-- ARGV[2] -> interval: microseconds between starts
-- ARGV[3] -> burst: starts that may begin at once
-- ARGV[4] -> window: the longest delay, in microseconds, the caller accepts
--
-- Returns {taken, delay, remaining, paused}: taken is 1 when the start was taken
-- (by this call, or by its first run when go-redis sent it again); delay is the
-- microseconds until the start may begin when taken, and otherwise until one could;
-- remaining is how many more could begin at once now; paused is the microseconds
-- left of a pause that holds the key back, 0 without one.
--
-- The lowest score is minus the key's TAT, a pause's included (see layout.go), so
-- the decision reads the set's first entry, and a start taken goes first. Whether
-- this call ran before is asked only when the answer depends on it: when ZADD NX
-- finds the member there, or before saying no.
local key, m = KEYS[1], ARGV[1]
local interval, burst, window = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0
local t = now()
local tau = burst * interval

local top = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
local last = -(top[2] or 0)
local tat = math.max(last, t)
local paused = 0
if top[1] == PAUSE then
  paused = math.max(last - tau + interval - t, 0)
end

local new = tat + interval
local delay = new - tau - t
if delay > window then
  local score = redis.call('ZSCORE', key, m)
  if score then
    return again(score, t, tat, interval, tau, paused)
  end
  return {0, delay, 0, paused}
end
if redis.call('ZADD', key, 'NX', int(-new), m) == 0 then
  return again(redis.call('ZSCORE', key, m), t, tat, interval, tau, paused)
end
if epoch(new) ~= epoch(last) then
  forget(key, t, new, last)
end
return {1, math.max(delay, 0), math.max(math.floor((t + tau - new) / interval), 0), paused}
