-- cancel: give back a start that has not begun, if no start was taken after it.
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> the member of the start
--
-- Returns 1 if the start was given back: the key's TAT is then what it was before
-- the start was taken. Returns 0 if a later start (or a pause ending later) was
-- taken since, which the start's TAT is part of, or the start is not there. A start
-- given back leaves its mark (layout.go), so that the call sent again after a lost
-- reply answers 1 too.
local key, m = KEYS[1], ARGV[1]
local top = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
if top[1] ~= m then
  if redis.call('ZSCORE', key, CANCELLED .. m) then
    return 1
  end
  return 0
end
redis.call('ZREM', key, m)
mark(key, now(), CANCELLED .. m, -top[2])
return 1
