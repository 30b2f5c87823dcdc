-- locked.lua: whether anyone holds the lock.
--
-- KEYS[1] -> <prefix>{<key>}  the lock (see common.lua for its value)
--
-- Returns 1 when the lock is held (by a value of another form too), 0 otherwise.
local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 17) ~= 114 then
  return 1
end
return 0
