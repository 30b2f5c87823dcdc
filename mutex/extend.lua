-- extend.lua: reset the lease of a lock our token holds.
--
-- KEYS[1] -> <prefix>{<key>}  the lock; value "<fence>:<token>", or "-:<token>" once released
-- ARGV[1] -> token
-- ARGV[2] -> new lease in milliseconds (replaces the remaining one)
--
-- Returns 1 when extended, 0 when the key is gone or holds another token (then
-- nothing changes). Safe to repeat.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) ~= 45 and string.sub(v, (string.find(v, ':', 1, true) or #v) + 1) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
