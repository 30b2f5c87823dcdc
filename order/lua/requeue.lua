-- requeue: announce that the task of a key's next place stopped and will run again
-- later (asynq retries it, or puts it back at a shutdown), so that the tasks waiting
-- for it judge it again instead of waiting for its finish. Nothing is written: it
-- publishes "<epoch>:<place>" followed by REQUEUED on the sequence's own name.
--
-- KEYS[1] -> the key's sequence, a hash (layout.go); also its channel
-- ARGV[1] -> the place's epoch
-- ARGV[2] -> the place
--
-- Returns 1 when the place is the key's next (announced), else 0.
local key, epoch, p = KEYS[1], ARGV[1], tonumber(ARGV[2])
local got = redis.call('HMGET', key, EPOCH, NEXT)
if got[1] ~= epoch or tonumber(got[2]) ~= p then
  return 0
end
redis.call('PUBLISH', key, epoch .. ':' .. int(p) .. REQUEUED)
return 1
