-- pttl.lua: remaining lease of a lock our token holds.
--
-- KEYS[1] -> <prefix>{<key>}  the lock; value "<fence>:<token>", or "-:<token>" once released
-- ARGV[1] -> token
--
-- Returns the remaining lease in milliseconds (-1: no expiry), or -3 when the key is
-- gone or holds another token.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) ~= 45 and string.sub(v, (string.find(v, ':', 1, true) or #v) + 1) == ARGV[1] then
  return redis.call('PTTL', KEYS[1])
end
return -3
