-- Arguments: numbers read defensively, so no ARGV can make a script raise.
-- An integer argument within [min, max], or `default` when it is not a number (or NaN).
local function int_arg(value, default, min, max)
  local n = tonumber(value)
  if not n or n ~= n then return default end
  return math.max(min, math.min(max, math.floor(n)))
end
-- A number our scripts stored (as text or in JSON), or nil for an absent key or field.
local function stored_int(value)
  if not value then return nil end
  return tonumber(value)
end
-- The server's clock in microseconds, and in milliseconds: the one place scripts read TIME.
local function server_now_us()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local function server_now_ms()
  return math.floor(server_now_us() / 1000)
end
