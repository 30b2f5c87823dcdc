-- unlock.lua: release the lock if our token holds it, and wake waiters.
--
-- KEYS[1] -> <prefix>{<key>}  the lock; value "<fence>:<token>"
-- ARGV[1] -> token
-- ARGV[2] -> release channel (the lock key's name); waiters of every Client subscribe to it
--
-- Returns 1 when released, 0 when the key is gone or holds another token (then
-- nothing changes). Repeating a release that was applied returns 0 and changes nothing.
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, (string.find(v, ':', 1, true) or #v) + 1) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '')
  return 1
end
return 0
