-- enter: whether a place's turn has come.
--
-- KEYS[1] -> the key's sequence, a hash (layout.go)
-- ARGV[1] -> the place's epoch
-- ARGV[2] -> the place
--
-- Returns {state, next, record, now}: state is 'turn' when the place is the key's
-- next, 'wait' when an earlier place is not finished, 'passed' when the key moved
-- past the place, 'unknown' when the key has no sequence of that epoch; next is the
-- key's next place (0 for 'unknown'); record is the next place's record ('' if
-- none); now is the server's time.
local key, epoch, p = KEYS[1], ARGV[1], tonumber(ARGV[2])
local t = int(now())
local got = redis.call('HMGET', key, EPOCH, NEXT)
if got[1] ~= epoch then
  return {'unknown', 0, '', t}
end
local nxt = tonumber(got[2])
if p == nxt then
  return {'turn', nxt, '', t}
elseif p < nxt then
  return {'passed', nxt, '', t}
end
return {'wait', nxt, redis.call('HGET', key, nxt) or '', t}
