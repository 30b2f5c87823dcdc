-- park: enter, and when an earlier place is not finished, mark the place parked: its
-- task waits in no process, and the Finish that makes the place the key's next
-- returns its ticket, for the caller to start the task (layout.go).
--
-- KEYS[1] -> the key's sequence, a hash (layout.go)
-- ARGV[1] -> the place's epoch
-- ARGV[2] -> the place
-- ARGV[3] -> the ticket
--
-- Returns what enter returns; the place is marked only when the state is 'wait'. A
-- place marked already keeps one mark, with the new ticket, no longer started ahead.
local key, p = KEYS[1], tonumber(ARGV[2])
local r = turn(key, ARGV[1], p)
if r[1] == 'wait' then
  local old = redis.call('HGET', key, PARKP .. int(p))
  redis.call('HSET', key, PARKP .. int(p), ARGV[3])
  if not old or string.sub(old, 1, #STARTED) == STARTED then
    redis.call('HINCRBY', key, PARKED, 1)
  end
end
return r
