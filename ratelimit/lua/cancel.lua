-- cancel: give back a start that has not begun, if no start was taken after it.
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> the member of the start
--
-- Returns 1 if the start was given back: the key's TAT is then what it was before
-- the start was taken. Returns 0 if a later start (or a pause ending later) was
-- taken since, which the start's TAT is part of, or the start is not there.
local top = redis.call('ZRANGE', KEYS[1], '0', '0')
if top[1] ~= ARGV[1] then
  return 0
end
return redis.call('ZREM', KEYS[1], ARGV[1])
