-- common.lua: what every script of this package starts with, after luaLayout
-- (layout.go). Times are microseconds of the server's clock, written with '%d' so
-- that none is written in a float's exponent form.

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function int(x)
  return string.format('%d', x)
end

-- haltedAt is the place the sequence at key halted at (layout.go), or nil.
local function haltedAt(key)
  local h = redis.call('HGET', key, HALTED)
  return h and tonumber(string.match(h, '^(%d+)'))
end

-- turn: where place p of epoch stands in the sequence at key (enter.lua's reply):
-- {state, next, record, now, ahead, halted}; with 'turn', ahead is 1 when the place
-- after p parked and was not started ahead (ahead.lua starts it); with 'wait',
-- halted is 1 when the key halted at its next place.
local function turn(key, epoch, p)
  local t = int(now())
  local got = redis.call('HMGET', key, EPOCH, NEXT)
  if got[1] ~= epoch then
    return {'unknown', 0, '', t, 0, 0}
  end
  local nxt = tonumber(got[2])
  if p == nxt then
    local behind = redis.call('HGET', key, PARKP .. int(p + 1))
    if behind and string.sub(behind, 1, #STARTED) ~= STARTED then
      return {'turn', nxt, '', t, 1, 0}
    end
    return {'turn', nxt, '', t, 0, 0}
  elseif p < nxt then
    return {'passed', nxt, '', t, 0, 0}
  end
  local ahead, halted = 0, 0
  local mark = redis.call('HGET', key, PARKP .. int(p))
  if mark and string.sub(mark, 1, #STARTED) == STARTED then
    ahead = 1
  end
  if haltedAt(key) == nxt then
    halted = 1
  end
  return {'wait', nxt, redis.call('HGET', key, nxt) or '', t, ahead, halted}
end

-- unpark: drop the park mark of place n of the sequence at key, if it has one, and
-- return it (false if none): the ticket, after STARTED if it was started ahead.
local function unpark(key, n)
  local ticket = redis.call('HGET', key, PARKP .. int(n))
  if ticket then
    redis.call('HDEL', key, PARKP .. int(n))
    if string.sub(ticket, 1, #STARTED) ~= STARTED then
      redis.call('HINCRBY', key, PARKED, -1)
    end
  end
  return ticket
end

-- startMark returns the park mark of place n of the sequence at key as it was (false
-- if none), and keeps it, flagged STARTED: its task is being started, and the mark
-- names it again to a finish sent again (finish.lua) until the place finishes.
local function startMark(key, n)
  local mark = redis.call('HGET', key, PARKP .. int(n))
  if mark and string.sub(mark, 1, #STARTED) ~= STARTED then
    redis.call('HSET', key, PARKP .. int(n), STARTED .. mark)
    redis.call('HINCRBY', key, PARKED, -1)
  end
  return mark
end

-- startedMark returns the park mark of place n of the sequence at key if it is
-- flagged STARTED, '' otherwise.
local function startedMark(key, n)
  local mark = redis.call('HGET', key, PARKP .. int(n))
  if mark and string.sub(mark, 1, #STARTED) == STARTED then
    return mark
  end
  return ''
end
