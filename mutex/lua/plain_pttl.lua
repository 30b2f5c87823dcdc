-- plain_pttl.lua: remaining lease of locks our token holds.
--
-- KEYS    -> <prefix>{<key>} of each lock (layout.go): one, or several held as one
--            (in Redis Cluster the caller sends one per call)
-- ARGV[1] -> identity of the holder
--
-- Returns the shortest remaining lease in milliseconds (-1: no expiry on any), or -3
-- when a key is gone or holds another token.
local least = -1
for i = 1, #KEYS do
  local v = redis.pcall('GET', KEYS[i]) -- an error: a lock with Limit(n) (a hash) took the key
  if not v or type(v) == 'table' or not held(v) or not ours(v, ARGV[1]) then
    return -3
  end
  local p = redis.call('PTTL', KEYS[i])
  if p >= 0 and (least < 0 or p < least) then
    least = p
  end
end
return least
