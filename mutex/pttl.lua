-- pttl.lua: remaining lease of a lock our token holds.
--
-- KEYS[1] -> <prefix>{<key>}  the lock (see common.lua for its value)
-- ARGV[1] -> token
--
-- Returns the remaining lease in milliseconds (-1: no expiry), or -3 when the key is
-- gone or holds another token.
local _, state, _, tok = parse(redis.call('GET', KEYS[1]))
if state and state ~= 'r' and tok == ARGV[1] then
  return redis.call('PTTL', KEYS[1])
end
return -3
