-- unwait.lua: take a waiter that gave up out of the queue.
--
-- KEYS[1] -> <prefix>{<key>}:wait   waiters: sorted set of "<client>.<waiter>"
-- KEYS[2] -> <prefix>{<key>}:claim  waiters: hash of "<client>.<waiter>" to claim deadline
-- ARGV[1] -> the waiter
--
-- Returns 1 when it was queued, 0 otherwise.
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
