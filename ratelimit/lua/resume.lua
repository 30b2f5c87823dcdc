-- resume: end a key's pause.
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> the call's random identity
--
-- Returns 1 if the key had a pause that still held it back, 0 if not. The pause
-- removed leaves a mark of the call and its answer (layout.go), so that the call
-- sent again after a lost reply answers as its first run did.
local key = KEYS[1]
local marks = {RESUMED .. ARGV[1] .. ' 0', RESUMED .. ARGV[1] .. ' 1'}
local s = redis.call('ZMSCORE', key, PAUSE, marks[1], marks[2])
if s[2] then
  return 0
elseif s[3] then
  return 1
elseif not s[1] then
  return 0
end
local t, hold = now(), -s[1]
local held = 0
if hold > t then
  held = 1
end
redis.call('ZREM', key, PAUSE)
mark(key, t, marks[held + 1], hold)
return held
