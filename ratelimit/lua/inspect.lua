-- inspect: a key's state, for people.
--
-- KEYS[1] -> the key's sorted set (layout.go)
--
-- Returns {now, pause, latest, latestTAT, starts, ahead}: the server's time; the TAT
-- the key's pause leaves it with, 0 without one; the member and TAT of the latest
-- start ('' and 0 without one); the number of starts remembered (those of the last 10
-- to 20 seconds and those reserved ahead); and of those, the starts that begin after
-- now, as read under the latest start's limit (a start's TAT less the limit's burst
-- of intervals is when it begins).
local key = KEYS[1]
local t = now()
local pause = -(redis.call('ZSCORE', key, PAUSE) or 0)
local top = redis.call('ZRANGE', key, '0', '1', 'WITHSCORES')
local latest, tat = '', 0
for i = 1, #top - 1, 2 do
  if string.sub(top[i], 1, 1) ~= '~' then
    latest, tat = top[i], -top[i + 1]
    break
  end
end
local n = redis.call('ZCOUNT', key, '-inf', '(0') -- not the marks
if pause > 0 then
  n = n - 1
end
local ahead = 0
local iv, b = string.match(latest, ' (%d+) (%d+)$')
if iv and tat > t then
  local after = t + iv * b -- a start scored below minus this begins after now
  ahead = redis.call('ZCOUNT', key, '-inf', '(' .. int(-after))
  if pause > after then
    ahead = ahead - 1
  end
end
return {int(t), int(pause), latest, int(tat), n, ahead}
