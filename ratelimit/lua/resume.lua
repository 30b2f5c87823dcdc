-- resume: end a key's pause.
--
-- KEYS[1] -> the key's sorted set (layout.go)
--
-- Returns 1 if the key had a pause, 0 if not.
return redis.call('ZREM', KEYS[1], PAUSE)
