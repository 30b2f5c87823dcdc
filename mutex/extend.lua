-- extend.lua: reset the lease of a lock our token holds.
--
-- KEYS[1] -> <prefix>{<key>}  the lock (see common.lua for its value)
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
-- ARGV[2] -> new lease in milliseconds (replaces the remaining one)
--
-- Returns 1 when extended, 0 when the key is gone or holds another token (then
-- nothing changes). Safe to repeat.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 17) ~= 114 and ours(v, ARGV[1]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
