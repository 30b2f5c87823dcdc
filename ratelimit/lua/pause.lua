-- pause: let no start of a key begin for a while.
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> microseconds the pause lasts from now
-- ARGV[2] -> interval: microseconds between starts of the key's limit
-- ARGV[3] -> burst of the key's limit
--
-- The pause is kept as the TAT that lets the first start begin when it ends and the
-- next ones at the limit's spacing (no burst): the end + (burst - 1) · interval. A
-- pause that holds the key back longer stays. The pause is kept also when starts
-- taken ahead reach past it: those due within it are given up when their callers come
-- for them (given_up, common.lua; confirm.lua), and taken again after the key's last.
-- Returns the microseconds the key is held back from now: the pause's, or a later
-- start's.
local key = KEYS[1]
local t = now()
local interval, burst = ARGV[2] + 0, ARGV[3] + 0
local hold = t + ARGV[1] + (burst - 1) * interval
local top = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
local last = -(top[2] or 0)
if hold > -(redis.call('ZSCORE', key, PAUSE) or 0) then
  redis.call('ZADD', key, int(-hold), PAUSE)
  if hold > last then
    forget(key, t, hold, last)
    last = hold
  end
end
return math.max(last - (burst - 1) * interval - t, 0)
