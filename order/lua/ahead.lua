-- ahead: start the parked task of the place after a place whose turn has come
-- ahead of its turn, as a finish does for the place after the one it makes the
-- key's next (finish.lua): its mark stays, flagged started, and its ticket is
-- returned for the caller to start.
--
-- KEYS[1] -> the key's sequence, a hash (layout.go)
-- ARGV[1] -> the place's epoch
-- ARGV[2] -> the place, the key's next
--
-- Returns the ticket, or '' when the place is not the key's next or the place after
-- it has no mark, or one flagged started already.
local key, p = KEYS[1], tonumber(ARGV[2])
local got = redis.call('HMGET', key, EPOCH, NEXT)
if got[1] ~= ARGV[1] or tonumber(got[2]) ~= p then
  return ''
end
local mark = startMark(key, p + 1)
if not mark or string.sub(mark, 1, #STARTED) == STARTED then
  return ''
end
return mark
