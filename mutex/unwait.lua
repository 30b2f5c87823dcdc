-- unwait.lua: take a waiter that gave up out of the queue.
--
-- KEYS[1] -> <prefix>{<key>}:wait  waiters: sorted set of "<client>.<waiter>"
-- ARGV[1] -> the waiter
--
-- Returns 1 when it was queued, 0 otherwise.
return redis.call('ZREM', KEYS[1], ARGV[1])
