-- locked.lua: whether anyone holds the lock.
--
-- KEYS[1] -> <prefix>{<key>}  the lock
--
-- Returns 1 when the key exists, 0 otherwise.
return redis.call('EXISTS', KEYS[1])
