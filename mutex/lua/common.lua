-- common.lua: what every script of this package starts with, after luaLayout
-- (layout.go), which defines the layout constants used here and in every script.
--
-- Callers pass their identity counted as the lock value stores it (a token's length
-- in LEN_DIGITS digits, then the token), so "our token holds it" is one comparison.
--
-- Fences come from the server clock: a new fence is max(previous fence + 1, server
-- time in microseconds). They keep increasing across a restart without persistence,
-- a restore from an older snapshot and a failover, as long as the server's clock does
-- not go back.
--
-- The code outside functions, here and in the files shared after it, runs once when
-- Redis loads the scripts as a function library (scripts.go), where the Lua
-- libraries (string, math, tonumber...) do not exist yet: it only defines constants
-- and functions.

local FENCE_FORMAT = '%0' .. FENCE_DIGITS .. 'd'

-- ours reports whether identity id holds (or, in a tombstone, released) value v.
local function ours(v, id)
  return string.sub(v, ID_AT, ID_AT - 1 + #id) == id
end

-- held reports whether value v is a lock that is held: not a tombstone.
local function held(v)
  return string.byte(v, STATE_AT) ~= RELEASED
end

-- fenceOf is the fence in value v.
local function fenceOf(v)
  return tonumber(string.sub(v, 1, FENCE_DIGITS))
end

-- holder is the identity in v, and the rest of v after the holder's description
-- (the previous holder's identity, or the mark of a release by force).
local function holder(v)
  local n = tonumber(string.sub(v, ID_AT, ID_AT + LEN_DIGITS - 1)) or -LEN_DIGITS
  local d = ID_AT + LEN_DIGITS + n
  local m = tonumber(string.sub(v, d, d + LEN_DIGITS - 1)) or -LEN_DIGITS
  return string.sub(v, ID_AT, d - 1), string.sub(v, d + LEN_DIGITS + m)
end

-- value is a lock value; state is HELD, WAITED or RELEASED; who is the holder's
-- identity followed by its description.
local function value(fence, state, since, who, prev)
  local f = string.format(FENCE_FORMAT, fence)
  return f .. string.char(state) .. (since == fence and f or string.format(FENCE_FORMAT, since)) .. who .. prev
end

-- withState is value v with another state.
local function withState(v, state)
  return string.sub(v, 1, STATE_AT - 1) .. string.char(state) .. string.sub(v, STATE_AT + 1)
end

-- tombstone is what a release by identity id leaves of value v, naming prev as the
-- previous holder.
local function tombstone(v, id, prev)
  return string.sub(v, 1, STATE_AT - 1) .. string.char(RELEASED) .. string.sub(v, SINCE_AT, ID_AT - 1) .. id .. NO_DESCRIPTION .. prev
end

-- markReleased records, when value v of lock is a tombstone about to be replaced by
-- another holder, that its releaser released it, for TOMBSTONE_MILLIS: a release
-- repeated after a lost reply then finds its mark however often the key changes hands
-- (plain_release.lua). The mark's key (layout.go) is computed here, as the releaser is
-- known only from v; it shares the lock's hash tag, so its Redis Cluster slot.
local function markReleased(lock, v)
  if v and not held(v) then
    local r = holder(v)
    if r ~= NO_DESCRIPTION then
      -- NX: a mark the release wrote itself (a slot's, with its own fence) stands.
      redis.call('SET', lock .. RELEASED_INFIX .. redis.sha1hex(r), string.sub(v, 1, FENCE_DIGITS), 'NX', 'PX', TOMBSTONE_MILLIS)
    end
  end
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
  local f = v and fenceOf(v) or 0
  return math.max(f + 1, now), now
end

-- entry reads a waiter's queue entry, "<client>.<waiter> <lease> <identity><description>":
-- it returns the client, the waiter, the lease as written ("<ms>", or "<ms>/<limit>"
-- in the queue of a lock with Limit(n)) and the rest, or nil for an entry of another
-- form.
local function entry(e)
  local dot = string.find(e, '.', 1, true)
  local s1 = string.find(e, ' ', 1, true)
  local s2 = s1 and string.find(e, ' ', s1 + 1, true)
  if not (dot and s2 and dot < s1) then
    return nil
  end
  return string.sub(e, 1, dot - 1), string.sub(e, dot + 1, s1 - 1), string.sub(e, s1 + 1, s2 - 1), string.sub(e, s2 + 1)
end

-- keyType is the Redis type of key k: "none", "string", "hash", ...
local function keyType(k)
  local t = redis.call('TYPE', k)
  if type(t) == 'table' then
    return t.ok or t[1]
  end
  return t
end
