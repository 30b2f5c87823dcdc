-- inspect: a key's sequence, for people.
--
-- KEYS[1] -> the key's sequence, a hash (layout.go)
--
-- Returns {epoch, next, last, skipped, record, now, parked, halted}: the sequence's
-- fields ('' and zeros when the key has none), the record of the next place ('' if
-- none), the server's time, how many places are parked, and the halted mark ('' if
-- none: "<place> <µs>", layout.go).
local key = KEYS[1]
local got = redis.call('HMGET', key, EPOCH, NEXT, LAST, SKIPPED, PARKED, HALTED)
local rec = ''
if got[2] then
  rec = redis.call('HGET', key, got[2]) or ''
end
return {got[1] or '', tonumber(got[2]) or 0, tonumber(got[3]) or 0, tonumber(got[4]) or 0, rec, int(now()), tonumber(got[5]) or 0, got[6] or ''}
