-- reset: forget every start of a key, those taken ahead included, so that its whole
-- burst may begin at once; its pause, if any, stays (resume.lua ends it), and so do
-- the marks of cancels and resumes.
--
-- KEYS[1] -> the key's sorted set (layout.go)
--
-- Returns the number of starts forgotten. The starts are the members with negative
-- scores but the pause, which goes with them and is put back with its score; the key
-- then expires as forget (common.lua) has it expire after the later of the pause's
-- TAT and now (a pause kept past its end), which is at least KEEP after every mark.
local key = KEYS[1]
local p = redis.call('ZSCORE', key, PAUSE)
local n = redis.call('ZREMRANGEBYSCORE', key, '-inf', '(0')
if p then
  n = n - 1
  redis.call('ZADD', key, p, PAUSE)
  redis.call('PEXPIREAT', key, int((epoch(math.max(-p, now())) + 2) * KEEP / 1000))
end
return n
