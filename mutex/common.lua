-- common.lua: the prelude every script of this package starts with.
--
-- The value of a lock key is read at fixed places, so that scripts compare rather
-- than parse:
--   bytes 1-16   the fencing token of the acquisition, 16 decimal digits;
--   byte 17      the state: "h" held; "w" held, and waiters may be queued (a release
--                must look); "r" released: a tombstone kept for a while so that a
--                release repeated after a lost reply is recognised; every script
--                treats it as a free lock;
--   bytes 18-33  when the holder got the lock: server time in microseconds, 16 digits;
--   bytes 34-    the holder's identity: its token's length in 4 decimal digits, then
--                the token (the releaser's, in a tombstone);
--   then         what the holder says about itself for people (host, process, task):
--                its length in 4 decimal digits, then the text; scripts never read it;
--   the rest     the identity of the holder that handed the lock over, or nothing, so
--                that its release, repeated after a lost reply, is recognised; or "!",
--                the identity of a holder whose lock was released by force and that
--                of the force release (force.lua), kept by the next holder too, so
--                that the old holder's release learns what happened. An identity
--                starts with its length, so neither can be read as a longer one.
-- Callers pass their identity in the same form, so "our token holds it" is one
-- comparison. A value of another form (set by hand) is held by nobody we know.
--
-- Fences come from the server clock: a new fence is max(previous fence + 1, server
-- time in microseconds). They keep increasing across a restart without persistence,
-- a restore from an older snapshot and a failover, as long as the server's clock does
-- not go back.

-- ours reports whether identity id holds (or, in a tombstone, released) value v.
local function ours(v, id)
  return string.sub(v, 34, 33 + #id) == id
end

-- holder is the identity in v, and the rest of v after the holder's description
-- (the previous holder's identity).
local function holder(v)
  local n = tonumber(string.sub(v, 34, 37)) or -4
  local m = tonumber(string.sub(v, 38 + n, 41 + n)) or -4
  return string.sub(v, 34, 37 + n), string.sub(v, 42 + n + m)
end

-- value is a lock value; who is the holder's identity followed by its description.
local function value(fence, state, since, who, prev)
  local f = string.format('%016d', fence)
  return f .. state .. (since == fence and f or string.format('%016d', since)) .. who .. prev
end

-- serverMicros is the server time in microseconds.
local function serverMicros()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- nextFence is the fence after value v's (v may be nil), and the server time in
-- microseconds.
local function nextFence(v)
  local now = serverMicros()
  local f = v and tonumber(string.sub(v, 1, 16)) or 0
  return math.max(f + 1, now), now
end

-- entry reads a waiter's queue entry, "<client>.<waiter> <lease> <identity><description>"
-- (lock.lua; the lease is "<ms>/<limit>" for Limit(n), sem_lock.lua): it returns the
-- client, the waiter, the lease as written and the rest, or nil for an entry of
-- another form.
local function entry(e)
  local dot = string.find(e, '.', 1, true)
  local s1 = string.find(e, ' ', 1, true)
  local s2 = s1 and string.find(e, ' ', s1 + 1, true)
  if not (dot and s2 and dot < s1) then
    return nil
  end
  return string.sub(e, 1, dot - 1), string.sub(e, dot + 1, s1 - 1), string.sub(e, s1 + 1, s2 - 1), string.sub(e, s2 + 1)
end
