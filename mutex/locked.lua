-- locked.lua: whether anyone holds the lock.
--
-- KEYS[1] -> <prefix>{<key>}  the lock; value "<fence>:<token>", or "-:<token>" once released
--
-- Returns 1 when the lock is held, 0 otherwise.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 1) ~= 45 then
  return 1
end
return 0
