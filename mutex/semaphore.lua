-- semaphore.lua: what the scripts of a lock with Limit(n), n > 1, share after
-- common.lua.
--
-- Such a lock is a Redis HASH at the key a plain lock of the same key would use:
--   "limit"           n, the number of holders it admits at once;
--   "fence"           the last fence issued (common.lua's rule: max(previous + 1,
--                     server time in microseconds));
--   "h" .. identity   one field per holder, its identity as common.lua writes it:
--                     "<lease end, server ms> <fence> <since, server µs> <description>",
--                     the description as in a plain lock's value;
--   "prev"            the identity of the plain lock whose release left the tombstone
--                     the hash replaced, if any (see release.lua).
-- The hash expires with its longest lease. A holder whose lease has ended is dropped
-- by every script that reads the whole hash, and its slot is handed on. When the last
-- holder leaves, the hash becomes a plain lock's tombstone (common.lua) that keeps the
-- last fence: free to both kinds of lock. The waiters queue at <key>:slots, not at a
-- plain lock's <key>:wait, so that neither kind of release hands the key to a waiter
-- of the other; their entries are a plain lock's (lock.lua) with "<lease ms>/<limit>"
-- for the lease, and a slot is handed over as handover.lua hands a plain lock.

-- semNow is the server time in microseconds and in milliseconds.
local function semNow()
  local us = serverMicros()
  return us, math.floor(us / 1000)
end

-- semType is the type of key k: "none", "string", "hash", ...
local function semType(k)
  local t = redis.call('TYPE', k)
  if type(t) == 'table' then
    return t.ok or t[1]
  end
  return t
end

-- semLoad reads the semaphore h as it is at server time ms, dropping holders whose
-- lease has ended. It returns s: live (holders left), limit (0 when unset), fence,
-- first and last (the earliest and latest lease end of the holders left, in ms),
-- held (the set of their fields), and mine, the value of field mine if that holder is
-- left (nil otherwise).
local function semLoad(h, ms, mine)
  local all = redis.call('HGETALL', h)
  local s = {live = 0, limit = 0, fence = 0, first = nil, last = 0, held = {}, mine = nil}
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if string.byte(f, 1) == 104 then -- "h": a holder
      local e = tonumber(string.match(v, '^%d+')) or 0
      if e <= ms then
        redis.call('HDEL', h, f)
      else
        s.live = s.live + 1
        s.held[f] = true
        if not s.first or e < s.first then
          s.first = e
        end
        s.last = math.max(s.last, e)
        if f == mine then
          s.mine = v
        end
      end
    elseif f == 'limit' then
      s.limit = tonumber(v) or 0
    elseif f == 'fence' then
      s.fence = tonumber(v) or 0
    end
  end
  return s
end

-- semGrant gives a slot of h to identity id (with description desc) for lease ms,
-- and returns its fence.
local function semGrant(h, s, id, desc, lease, us, ms)
  local f = math.max(s.fence + 1, us)
  s.fence = f
  local e = ms + lease
  redis.call('HSET', h, 'h' .. id, string.format('%d %d %d ', e, f, us) .. desc, 'fence', string.format('%d', f))
  s.live = s.live + 1
  s.held['h' .. id] = true
  if not s.first or e < s.first then
    s.first = e
  end
  s.last = math.max(s.last, e)
  return f
end

-- semHandOver gives the free slots of h to the oldest waiters of queue q whose
-- client is listening, as handOver (handover.lua) gives a plain lock: the entry is
-- taken out, the waiter gets a slot with its own lease and a new fence, and its
-- client gets "<waiter> <fence>" on chan .. <client>; a waiter nobody heard (when
-- counts is "1") loses the slot again and the next is tried. An entry's lease is
-- "<ms>/<limit>": a waiter under a limit other than h's is taken out and gets
-- "<waiter> 0", so that it tries again at once and learns of the limit in force.
-- Entries of identities s.held marks as holders are dropped. When self, the caller's
-- own entry, comes up, the caller takes the slot itself for lease ms (identity id,
-- description desc) and its fence is returned; otherwise nil. Entries of another
-- form are dropped.
local function semHandOver(h, q, s, self, id, desc, lease, chan, counts, us, ms)
  while s.live < s.limit do
    local e = redis.call('LPOP', q)
    if not e then
      return nil
    end
    if e == self then
      return semGrant(h, s, id, desc, lease, us, ms)
    end
    local client, waiter, lf, who = entry(e)
    local ls, lim
    if client then
      ls, lim = string.match(lf, '^(%d+)/(%d+)$')
    end
    local l = tonumber(ls)
    local n = l and tonumber(string.sub(who, 1, 4))
    if n and l > 0 and tonumber(lim) ~= s.limit then
      -- A waiter under another limit: out of the queue, and told to try again now,
      -- which tells it of the limit in force (its fence 0 means no slot).
      redis.call('PUBLISH', chan .. client, waiter .. ' 0')
    elseif n and l > 0 then
      local wid = string.sub(who, 1, 4 + n)
      if not s.held['h' .. wid] then
        local f = semGrant(h, s, wid, string.sub(who, 5 + n), l, us, ms)
        local got = redis.call('PUBLISH', chan .. client, waiter .. ' ' .. string.format('%d', f))
        if got == 0 and counts == '1' then
          redis.call('HDEL', h, 'h' .. wid)
          s.live = s.live - 1
          s.held['h' .. wid] = nil
        end
      end
    end
  end
  return nil
end

-- semStore sets h's expiry to its longest lease, or, when nobody holds it, replaces
-- it with a plain lock's tombstone that keeps the last fence for tomb ms, naming id
-- (an identity, or "0000") as the releaser.
local function semStore(h, s, id, us, ms, tomb)
  if s.live > 0 then
    redis.call('PEXPIRE', h, math.max(s.last - ms, 1))
    return
  end
  redis.call('DEL', h)
  redis.call('SET', h, value(s.fence, 'r', us, id .. '0000', ''), 'PX', tomb)
end
