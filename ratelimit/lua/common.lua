-- common.lua: what every script of this package starts with, after luaLayout
-- (layout.go). Times are microseconds of the server's clock. A score is minus a
-- time (layout.go), written with '%d' so that none is written in a float's exponent
-- form. Strings from Redis are turned into numbers by arithmetic ('x + 0', '-x'),
-- which parses them once, where tonumber parses them twice; numbers are passed to
-- redis.call as strings, which Redis would otherwise format as floats.

-- now is the server's time.
local function now()
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end

local function int(x)
  return string.format('%d', x)
end

-- The starts of a key are kept KEEP after their TAT, and the key itself expires when
-- its last start and its pause are forgotten. Rather than trim and expire on every
-- start, a script does both when the key's TAT enters a new epoch (KEEP long): it
-- forgets the starts older than KEEP and sets the key to expire at the end of the
-- epoch after next. So a key always expires after the end of the epoch after its
-- TAT's, which is at least KEEP after that TAT, and a start is forgotten between KEEP
-- and 2·KEEP after its TAT.
local function epoch(us)
  return math.floor(us / KEEP)
end

-- forget is called when the TAT of key, tat, entered a new epoch; old is the TAT
-- before, 0 if key did not exist. It trims starts and the pause (negative scores),
-- never the marks of cancels and resumes (positive; see forgetMarks).
local function forget(key, t, tat, old)
  if old > 0 then
    redis.call('ZREMRANGEBYSCORE', key, '(' .. int(KEEP - t), '(0')
  end
  redis.call('PEXPIREAT', key, int((epoch(tat) + 2) * KEEP / 1000))
end

-- again is take's answer to a call sent again after a lost reply, whose first run
-- took the start whose score is score (take.lua's reply; t, tat, interval, tau and
-- paused are take's). It is defined here, once, rather than as a closure in take,
-- which every call would make anew.
local function again(score, t, tat, interval, tau, paused)
  local at = -score - tau
  return {1, math.max(at - t, 0), math.max(math.floor((t + tau - tat) / interval), 0), paused, 1, t - at}
end

-- given_up reports whether a named call (take.lua's stale above 0) gives up the
-- start it finds, scored score, to take another: the start was due more than stale
-- ago (its caller came back late: beginning now would add a start to a window the
-- key's later starts fill), or a pause that began after it was taken holds it back
-- (it begins before the pause's end, read as confirm.lua reads it). A pause there
-- when the start was taken ends at its due time or before, so does not count.
local function given_up(key, score, t, interval, burst, stale)
  if stale == 0 then
    return false
  end
  local at = -score - burst * interval
  if t - at > stale then
    return true
  end
  local p = redis.call('ZSCORE', key, PAUSE)
  return p ~= false and at < -p - (burst - 1) * interval
end

-- mark replaces what a cancel or a resume removed with a mark of the call, scored
-- with the time now (positive, so never the TAT a decision reads), and forgets the
-- marks older than KEEP. The key must live KEEP more, for a call sent again to find
-- the mark: tat is the key's TAT before, which its expiry covers by KEEP.
local function mark(key, t, name, tat)
  redis.call('ZREMRANGEBYSCORE', key, '0', '(' .. int(t - KEEP))
  redis.call('ZADD', key, int(t), name)
  if epoch(t) > epoch(tat) then
    redis.call('PEXPIREAT', key, int((epoch(t) + 2) * KEEP / 1000))
  end
end
