-- inspect: a key's state, for people.
--
-- KEYS[1] -> the key's sorted set (layout.go)
--
-- Returns {now, pause, latest, latestScore, starts}: the server's time; the score of
-- the key's pause, 0 without one; the member and score of the latest start ('' and
-- 0 without one); the number of starts remembered (those of the last 10 to 20
-- seconds and those reserved ahead).
local key = KEYS[1]
local t = now()
local pause = tonumber(redis.call('ZSCORE', key, PAUSE)) or 0
local top = redis.call('ZRANGE', key, -2, -1, 'WITHSCORES')
local latest, score = '', 0
for i = #top - 1, 1, -2 do
  if top[i] ~= PAUSE then
    latest, score = top[i], top[i + 1]
    break
  end
end
local n = redis.call('ZCARD', key)
if pause > 0 then
  n = n - 1
end
return {int(t), int(pause), latest, score, n}
