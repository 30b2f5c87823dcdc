-- common.lua: the prelude every script of this package starts with.
--
-- The value of a lock key is read at fixed places, so that scripts compare rather
-- than parse:
--   bytes 1-16   the fencing token of the acquisition, 16 decimal digits;
--   byte 17      the state: "h" held; "w" held, and waiters may be queued (a release
--                must look); "r" released: a tombstone kept for a while so that a
--                release repeated after a lost reply is recognised; every script
--                treats it as a free lock;
--   bytes 18-    the holder's identity: its token's length in 4 decimal digits, then
--                the token (the releaser's, in a tombstone);
--   the rest     the identity of the holder that handed the lock over, or nothing, so
--                that its release, repeated after a lost reply, is recognised.
-- Callers pass their identity in the same form, so "our token holds it" is one
-- comparison. A value of another form (set by hand) is held by nobody we know.
--
-- Fences come from the server clock: a new fence is max(previous fence + 1, server
-- time in microseconds). They keep increasing across a restart without persistence,
-- a restore from an older snapshot and a failover, as long as the server's clock does
-- not go back.

-- ours reports whether identity id holds (or, in a tombstone, released) value v.
local function ours(v, id)
  return string.sub(v, 18, 17 + #id) == id
end

-- holder is the identity in v, and the rest of v after it (the previous holder's).
local function holder(v)
  local n = tonumber(string.sub(v, 18, 21)) or -4
  return string.sub(v, 18, 21 + n), string.sub(v, 22 + n)
end

local function value(fence, state, id, prev)
  return string.format('%016d', fence) .. state .. id .. prev
end

-- nextFence is the fence after value v's (v may be nil).
local function nextFence(v)
  local t = redis.call('TIME')
  local f = v and tonumber(string.sub(v, 1, 16)) or 0
  return math.max(f + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
end
