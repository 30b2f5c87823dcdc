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
