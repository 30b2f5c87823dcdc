-- confirm: before a start taken ahead begins, check that no pause began since.
--
-- KEYS[1] -> the key's sorted set (layout.go)
-- ARGV[1] -> the member of the start
-- ARGV[2] -> interval: microseconds between starts of the key's limit
-- ARGV[3] -> burst of the key's limit
--
-- Returns 0 if the start may begin now. If a pause holds the key back, gives the
-- start back and returns the microseconds until the pause ends.
local key, m = KEYS[1], ARGV[1]
local p = redis.call('ZSCORE', key, PAUSE)
if not p then
  return 0
end
local t = now()
local ends = -p - (ARGV[3] - 1) * ARGV[2]
if ends <= t then
  return 0
end
redis.call('ZREM', key, m)
return ends - t
