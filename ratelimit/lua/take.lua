-- take: take a start of a key if it may begin within a window (GCRA).
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> the call's member: "<identity> <interval> <burst>"
-- ARGV[2] -> interval: microseconds between starts
-- ARGV[3] -> burst: starts that may begin at once
-- ARGV[4] -> window: the longest delay, in microseconds, the caller accepts
-- ARGV[5] -> stale: for a call whose identity names its caller (TakeAs), the
--            microseconds after its start was due past which a start it finds again
--            is given up and another taken; 0 for a call with a random identity,
--            whose start found again is always its first run's
-- ARGV[6] -> cost: how many starts this one counts as (Rate.Cost), at least 1
--
-- Returns {taken, delay, remaining, paused, found, late}: taken is 1 when the start
-- was taken (by this call, by its first run when go-redis sent it again, or by an
-- earlier call of a named caller); delay is the
-- microseconds until the start may begin when taken, and otherwise until one could;
-- remaining is how many more of cost 1 could begin at once now; paused is the microseconds
-- left of a pause that holds the key back, 0 without one; found is 1 when the call
-- found a start taken before for its member (kept, or given up), and late then the
-- microseconds after that start was due that the call came (negative: before).
--
-- The lowest score is minus the key's TAT, a pause's included (see layout.go), so
-- the decision reads the set's first entry, and a start taken goes first. Whether
-- this call ran before is asked only when the answer depends on it: when ZADD NX
-- finds the member there, or before saying no. A named call that finds a start
-- given up (see given_up) decides afresh: a refusal leaves the old start to lapse,
-- a start taken moves the member (ZADD XX) to its new TAT, which is above every TAT
-- kept: neither lowers the key's TAT.
local key, m = KEYS[1], ARGV[1]
local interval, burst, window, stale, cost = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0, ARGV[5] + 0, ARGV[6] + 0
local t = now()
local tau = burst * interval

local top = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
local last = -(top[2] or 0)
local tat = math.max(last, t)
local paused = 0
if top[1] == PAUSE then
  paused = math.max(last - tau + interval - t, 0)
end

local new = tat + cost * interval
local delay = new - tau - t
if delay > window then
  local score = redis.call('ZSCORE', key, m)
  if score and not given_up(key, score, t, interval, burst, stale) then
    return again(score, t, tat, interval, tau, paused)
  end
  if score then
    return {0, delay, 0, paused, 1, t + score + tau}
  end
  return {0, delay, 0, paused, 0, 0}
end
local found, late = 0, 0
if redis.call('ZADD', key, 'NX', int(-new), m) == 0 then
  local score = redis.call('ZSCORE', key, m)
  if not given_up(key, score, t, interval, burst, stale) then
    return again(score, t, tat, interval, tau, paused)
  end
  found, late = 1, t + score + tau
  redis.call('ZADD', key, 'XX', int(-new), m)
end
if epoch(new) ~= epoch(last) then
  forget(key, t, new, last)
end
return {1, math.max(delay, 0), math.max(math.floor((t + tau - new) / interval), 0), paused, found, late}
