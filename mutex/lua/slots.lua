-- slots.lua: what the scripts of a lock with Limit(n), n > 1, share after common.lua
-- and line.lua.
--
-- Such a lock is a Redis HASH at the key a plain lock of the same key would use, with
-- its waiters at <key>:slots (layout.go). A holder whose lease has ended is dropped by
-- every script that reads the whole hash, and its slot is handed on. When the last
-- holder leaves, the hash becomes a plain lock's tombstone that keeps the last fence:
-- free to both kinds of lock. A slot is handed to a waiter as handOver (plain.lua)
-- hands a plain lock.

-- slotsCall is one script call's view of the lock: its hash h, its queue q, the
-- channel prefix and PUBLISH's counting (as in plain_release.lua), and the server
-- time, read once, in µs and ms.
local function slotsCall(h, q, chan, counts)
  local us = serverMicros()
  return {h = h, q = q, chan = chan, counts = counts, us = us, ms = math.floor(us / 1000)}
end

-- slotsLoad reads the hash as it is at the call's time, dropping holders whose lease
-- has ended. It returns s: live (holders left), limit (0 when unset), fence, first and
-- last (the earliest and latest lease end of the holders left, in ms), held (the set
-- of their fields), and mine, the value of field mine if that holder is left (nil
-- otherwise).
local function slotsLoad(c, mine)
  local all = redis.call('HGETALL', c.h)
  local s = {live = 0, limit = 0, fence = 0, first = nil, last = 0, held = {}, mine = nil}
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if string.sub(f, 1, #SLOT_HOLDER) == SLOT_HOLDER then
      local e = tonumber(string.match(v, '^%d+')) or 0
      if e <= c.ms then
        redis.call('HDEL', c.h, f)
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
    elseif f == SLOTS_LIMIT then
      s.limit = tonumber(v) or 0
    elseif f == SLOTS_FENCE then
      s.fence = tonumber(v) or 0
    end
  end
  return s
end

-- slotsOpen reads the lock of call c as slotsLoad does (mine as there), for a caller
-- that takes it with limit n (0: whatever limit the hash has): a plain lock's
-- tombstone gives way to the hash, which keeps its fence (its releaser keeps its
-- mark), and a hash nobody holds takes n as its limit. It returns s; or nil and the
-- answer of slots_lock.lua for a key it cannot read as a lock with Limit(n): {-2,
-- pttl} when a plain lock holds it, {-3, 0} when it holds another type.
local function slotsOpen(c, n, mine)
  local t = keyType(c.h)
  local base = 0
  if t == 'string' then
    local v = redis.call('GET', c.h)
    if held(v) then
      return nil, {-2, redis.call('PTTL', c.h)}
    end
    base = fenceOf(v) or 0
    markReleased(c.h, v) -- the tombstone goes: its releaser keeps its mark
    redis.call('DEL', c.h)
  elseif t ~= 'hash' and t ~= 'none' then
    return nil, {-3, 0}
  end
  local s = slotsLoad(c, mine)
  s.fence = math.max(s.fence, base)
  if n > 0 and s.live == 0 and s.limit ~= n then
    s.limit = n
    redis.call('HSET', c.h, SLOTS_LIMIT, string.format('%d', n))
  end
  return s
end

-- slotsGrant gives a slot to identity id (with description desc) for lease ms, and
-- returns its fence.
local function slotsGrant(c, s, id, desc, lease)
  local f = math.max(s.fence + 1, c.us)
  s.fence = f
  local e = c.ms + lease
  redis.call('HSET', c.h, SLOT_HOLDER .. id, string.format('%d %d %d ', e, f, c.us) .. desc, SLOTS_FENCE, string.format('%d', f))
  s.live = s.live + 1
  s.held[SLOT_HOLDER .. id] = true
  if not s.first or e < s.first then
    s.first = e
  end
  s.last = math.max(s.last, e)
  return f
end

-- slotsHandOver gives the free slots to the oldest waiters whose client is listening,
-- and to parked tasks (line.lua), in the order of the queue, as handOver (plain.lua)
-- gives a plain lock: the entry is taken out, the waiter gets a slot with its own
-- lease and a new fence, and its client gets "<waiter> <fence>"; a waiter nobody
-- heard (when PUBLISH counts) loses the slot again and the next is tried. A parked
-- task's slot is held by its parked identity for its claim, and its ticket is added
-- to start, as "1 <mark><ticket>", for the caller's Starter to start it; it claims
-- the slot when it arrives (slots_lock.lua). When anything was handed over, the
-- parked task at the head of the queue, if any, is started ahead of its turn
-- (prestart). A nil start (a caller that starts nobody) collects no ticket and starts
-- nobody ahead. A waiter under a limit other than the hash's is taken out and gets
-- "<waiter> WAKE_RETRY", so that it tries again at once and learns of the limit in
-- force. Entries of identities s.held marks as holders, and entries of another form,
-- are dropped. me is the caller's own place, {entry, ticket, id, desc, lease}, or nil:
-- when its entry (or a parked entry of its ticket) comes up, the caller takes the
-- slot itself and its fence is returned; otherwise nil.
local function slotsHandOver(c, s, me, start)
  local given = false
  local function went()
    if given and start then
      prestart(c.q, start, 1)
    end
  end
  while s.live < s.limit do
    local e = redis.call('LPOP', c.q)
    if not e then
      break
    end
    local mark, t = parkedEntry(e)
    if me and (e == me.entry or (mark and t == me.ticket)) then
      local f = slotsGrant(c, s, me.id, me.desc, me.lease)
      given = true
      went()
      return f
    end
    local client, waiter, lf, who = entry(e)
    local ls, lim = nil, nil
    if mark then
      ls, lim, who = lf, s.limit, who and afterSince(who)
    elseif client then
      ls, lim = string.match(lf, '^(%d+)/(%d+)$')
    end
    local l = tonumber(ls)
    local n = l and who and tonumber(string.sub(who, 1, LEN_DIGITS))
    if n and l > 0 and tonumber(lim) ~= s.limit then
      redis.call('PUBLISH', c.chan .. client, waiter .. ' ' .. WAKE_RETRY)
    elseif n and l > 0 then
      local wid = string.sub(who, 1, LEN_DIGITS + n)
      if not s.held[SLOT_HOLDER .. wid] then
        local f = slotsGrant(c, s, wid, string.sub(who, LEN_DIGITS + 1 + n), l)
        if mark then
          given = true
          if start then
            start[#start + 1] = '1 ' .. mark .. t
          end
        elseif redis.call('PUBLISH', c.chan .. client, waiter .. ' ' .. string.format('%d', f)) > 0 or c.counts ~= '1' then
          given = true
        else
          redis.call('HDEL', c.h, SLOT_HOLDER .. wid)
          s.live = s.live - 1
          s.held[SLOT_HOLDER .. wid] = nil
        end
      end
    end
  end
  went()
  return nil
end

-- slotsStore sets the hash's expiry to its longest lease, or, when nobody holds it,
-- replaces it with a plain lock's tombstone that keeps the last fence for tomb ms,
-- naming id (an identity, or NO_DESCRIPTION for nobody) as the releaser.
local function slotsStore(c, s, id, tomb)
  if s.live > 0 then
    redis.call('PEXPIRE', c.h, math.max(s.last - c.ms, 1))
    return
  end
  redis.call('DEL', c.h)
  redis.call('SET', c.h, value(s.fence, RELEASED, c.us, id .. NO_DESCRIPTION, ''), 'PX', tomb)
end
