-- plain_extend.lua: reset the lease of locks our token holds.
--
-- KEYS    -> <prefix>{<key>} of each lock (layout.go): one, or several held as one
--            (in Redis Cluster the caller sends one per call)
-- ARGV[1] -> identity of the holder
-- ARGV[2] -> new lease in milliseconds (replaces the remaining one)
--
-- Returns 1 when extended, 0 when a key is gone or holds another token (then
-- nothing changes). Safe to repeat.
for i = 1, #KEYS do
  local v = redis.pcall('GET', KEYS[i]) -- an error: a lock with Limit(n) (a hash) took the key
  if not v or type(v) == 'table' or not held(v) or not ours(v, ARGV[1]) then
    return 0
  end
end
for i = 1, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return 1
