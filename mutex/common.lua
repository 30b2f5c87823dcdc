-- common.lua: the prelude every script of this package starts with.
--
-- The value of a lock key is "<fence>:<state>:<n>:<prev><token>":
--   fence  the fencing token of the acquisition (decimal);
--   state  "h" held; "w" held, and waiters may be queued (a release must look);
--          "r" released: a tombstone kept for a while so that a release repeated
--          after a lost reply is recognised; every script treats it as a free lock;
--   n      the length in bytes of prev;
--   prev   the token of the holder that handed the lock over ("" if none), so that
--          its release, repeated after a lost reply, is recognised;
--   token  the token of the holder (of the releaser, in a tombstone).
-- A value of another form (set by hand) is held by nobody we know.
--
-- Fences come from the server clock: a new fence is max(previous fence + 1, server
-- time in microseconds). They keep increasing across a restart without persistence,
-- a restore from an older snapshot and a failover, as long as the server's clock does
-- not go back.

-- parse returns fence, state, prev, token of a lock value, or nil when v is absent or
-- not of our form.
local function parse(v)
  if not v then
    return nil
  end
  local i = string.find(v, ':', 1, true)
  if not i or string.sub(v, i + 2, i + 2) ~= ':' then
    return nil
  end
  local j = string.find(v, ':', i + 3, true)
  local f = tonumber(string.sub(v, 1, i - 1))
  local n = j and tonumber(string.sub(v, i + 3, j - 1))
  if not (f and n) then
    return nil
  end
  return f, string.sub(v, i + 1, i + 1), string.sub(v, j + 1, j + n), string.sub(v, j + n + 1)
end

local function value(fence, state, prev, token)
  return string.format('%d', fence) .. ':' .. state .. ':' .. #prev .. ':' .. prev .. token
end

-- nextFence is the fence after f (0: none known).
local function nextFence(f)
  local t = redis.call('TIME')
  return math.max(f + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
end
