-- finish: mark a place finished, if it is the key's next, and wake the key's waiters:
-- it publishes the new next place, "<epoch>:<place>" as FormatPlace writes it, on the
-- sequence's own name, followed, when the place is taken, by a space, the server's
-- time and a space, and the place's record (layout.go).
--
-- KEYS[1] -> the key's sequence, a hash (layout.go); also its channel
-- ARGV[1] -> the place's epoch
-- ARGV[2] -> the place
-- ARGV[3] -> how: 'done' (its task finished), 'skip' (the key moves past it without
--            its task, by a gap rule), 'force' (a person moves the key past it),
--            'abandon' (its producer could not enqueue the task), 'halt' (its task
--            failed for good and the key halts there)
--
-- 'halt' moves nothing: the key's next place is marked halted (HALTED, layout.go),
-- and the waiters are told as by requeue.lua, to judge the key again; next is then
-- the place when this call halted the key, 0 when it was halted there already. A halted place
-- is not moved past by 'skip' (nothing changes); 'done' and 'force' move past it and
-- drop the mark.
--
-- Returns {next, ticket, ahead, at}: next is the key's next place after the call, or
-- 0 when the place was not the key's next (another call finished it, or an earlier
-- place is not finished: then 'abandon' marks the place so that the key moves past it
-- when its turn comes) or the key has no sequence of that epoch. The places after it
-- that were abandoned are finished with it. ticket is the park mark of the key's next
-- place (see park.lua), for the caller to start its task ('' when it has none), after
-- STARTED if it was started before; ahead is the mark of the place after that, when
-- it parked, which the caller starts ahead of its turn, to wait for it in a process;
-- at is the key's next place, the place of ticket. Both marks stay, flagged STARTED,
-- until their place finishes: a finish of the place just before the key's next (one
-- go-redis sent again after a lost reply, or a second finisher's) names the started
-- ones again, so that a start a lost reply missed is made; starting a task twice
-- does nothing more. A key with no place left unfinished expires after KEEP_MS.
local key, epoch, p, how = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local got = redis.call('HMGET', key, EPOCH, NEXT)
if got[1] ~= epoch then
  return {0, '', '', 0}
end
local nxt = tonumber(got[2])
if p == nxt and (how == 'halt' or how == 'skip') then
  local at = haltedAt(key)
  if how == 'halt' then
    local halted = 0
    if at ~= p then
      redis.call('HSET', key, HALTED, int(p) .. ' ' .. int(now()))
      halted = p
    end
    redis.call('PUBLISH', key, epoch .. ':' .. int(p) .. REQUEUED)
    return {halted, '', '', 0}
  elseif at == p then
    return {0, '', '', 0}
  end
end
if p ~= nxt then
  if how == 'abandon' and p > nxt then
    local rec = redis.call('HGET', key, p)
    if rec and string.sub(rec, 1, #ABANDONED + 1) ~= ABANDONED .. ' ' then
      redis.call('HSET', key, p, ABANDONED .. ' ' .. rec)
    end
  end
  if p == nxt - 1 then
    return {0, startedMark(key, nxt), startedMark(key, nxt + 1), nxt}
  end
  return {0, '', '', 0}
end
local last = tonumber(redis.call('HGET', key, LAST))
local skipped = 0
if how ~= 'done' then
  skipped = 1
end
-- finish drops the record of place n and its task's index.
local function finish(n)
  local rec = redis.call('HGET', key, n)
  if rec then
    local id = string.match(rec, '^[^ ]+ [^ ]+ (.*)$')
    if string.sub(rec, 1, #ABANDONED + 1) == ABANDONED .. ' ' then
      id = string.match(string.sub(rec, #ABANDONED + 2), '^[^ ]+ [^ ]+ (.*)$')
    end
    if id then
      redis.call('HDEL', key, IDP .. id)
    end
    redis.call('HDEL', key, n)
  end
  unpark(key, n)
end
finish(p)
if haltedAt(key) == p then
  redis.call('HDEL', key, HALTED)
end
nxt = p + 1
while nxt <= last do
  local rec = redis.call('HGET', key, nxt)
  if not rec or string.sub(rec, 1, #ABANDONED + 1) ~= ABANDONED .. ' ' then
    break
  end
  finish(nxt)
  skipped = skipped + 1
  nxt = nxt + 1
end
redis.call('HSET', key, NEXT, nxt)
if skipped > 0 then
  redis.call('HINCRBY', key, SKIPPED, skipped)
end
if nxt > last then
  redis.call('PEXPIRE', key, KEEP_MS)
end
-- The announcement names the new next place's holder, so that a waiter whose place
-- is later judges it without asking again.
local msg, ticket, ahead = epoch .. ':' .. int(nxt), '', ''
if nxt <= last then
  ticket = startMark(key, nxt) or ''
  local mark = startMark(key, nxt + 1)
  if mark and string.sub(mark, 1, #STARTED) ~= STARTED then
    ahead = mark
  end
  local rec = redis.call('HGET', key, nxt)
  if rec then
    msg = msg .. ' ' .. int(now()) .. ' ' .. rec
  end
end
redis.call('PUBLISH', key, msg)
return {nxt, ticket, ahead, nxt}
