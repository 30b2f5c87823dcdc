-- pttl.lua: remaining lease of a lock our token holds.
--
-- KEYS[1] -> <prefix>{<key>}  the lock (see common.lua for its value)
-- ARGV[1] -> identity of the holder: its token's length in 4 digits, then the token
--
-- Returns the remaining lease in milliseconds (-1: no expiry), or -3 when the key is
-- gone or holds another token.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 17) ~= 114 and ours(v, ARGV[1]) then
  return redis.call('PTTL', KEYS[1])
end
return -3
