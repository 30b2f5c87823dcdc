-- take: give a task the next place in its key's sequence.
--
-- KEYS[1] -> the key's sequence, a hash (layout.go)
-- ARGV[1] -> the task's queue (no spaces)
-- ARGV[2] -> the task's ID
--
-- Returns {epoch, place}: the sequence's epoch (begun now if the key had none) and
-- the place taken. A task ID that holds a place not finished already gets that place
-- again, so that a call go-redis sends again after a lost reply takes no second one.
local key, queue, id = KEYS[1], ARGV[1], ARGV[2]
local t = now()
local epoch = redis.call('HGET', key, EPOCH)
if not epoch then
  epoch = int(t)
  redis.call('HSET', key, EPOCH, epoch, LAST, 0, NEXT, 1, SKIPPED, 0)
end
local held = redis.call('HGET', key, IDP .. id)
if held then
  return {epoch, tonumber(held)}
end
local n = redis.call('HINCRBY', key, LAST, 1)
redis.call('HSET', key, n, int(t) .. ' ' .. queue .. ' ' .. id, IDP .. id, n)
redis.call('PERSIST', key)
return {epoch, n}
