-- rate_limit: decide whether one task of a rate-limited type may start now (Redis server clock).
-- KEYS[1] the type's rate hash. Fields: tat (GCRA theoretical arrival time), window + count
--         (fixed window), cursor (end of the queue of reserved slots), r:<task id> (a slot
--         reserved for a task that was denied). All times are microseconds of the server clock.
-- ARGV[1] algorithm: "gcra" or "fixed_window"
-- ARGV[2] task id
-- ARGV[3] limit: starts per period (fixed_window)
-- ARGV[4] period in microseconds
-- ARGV[5] emission interval in microseconds: GCRA's increment, and the spacing of reserved slots
-- ARGV[6] GCRA tolerance in microseconds: how long before its theoretical arrival time a start
--         is admitted (gcra only)
-- Returns: 0 when the task may start now, else the microseconds until its reserved slot.
-- An argument that is not a number falls back to a default (limit 1, period 1 s, emission one
-- period, tolerance 0); a stored field that is not a finite number counts as absent.
--
-- A denied task is given the next free slot of a queue spaced by the emission interval, so
-- denied tasks wake one by one instead of all at once. While that queue is not empty, only
-- tasks holding a reservation may start; a newcomer joins the end of the queue.
-- include: args
local now = server_now_us()
local key = KEYS[1]
local algorithm = ARGV[1]
local reservation = 'r:' .. ARGV[2]
local limit = int_arg(ARGV[3], 1, 1, 2 ^ 53)
local period = int_arg(ARGV[4], 1000000, 1, 2 ^ 53)
local emission = int_arg(ARGV[5], period, 1, 2 ^ 53)
local tolerance = int_arg(ARGV[6], 0, 0, 2 ^ 53)

-- A stored field that is not a finite number (a foreign write: "x", "nan", "inf") counts as absent.
local function stored(value)
  local n = tonumber(value)
  if n and n > -math.huge and n < math.huge then return n end
  return nil
end

local state = redis.call('HMGET', key, 'tat', 'window', 'count', 'cursor', reservation)
local cursor = stored(state[4]) or 0
local reserved = state[5] ~= false

-- Numbers go to Redis as integer text: Lua's own conversion writes 1e+14 past 14 digits.
local function num(value)
  return string.format('%.0f', value)
end

-- The earliest time the algorithm admits a start, and the fields an admission now would write.
local earliest, admitted, horizon
if algorithm == 'gcra' then
  local tat = stored(state[1]) or now
  earliest = tat - tolerance
  horizon = math.max(tat, now) + emission
  admitted = {'tat', num(horizon)}
elseif algorithm == 'fixed_window' then
  local window = math.floor(now / period)
  local count = 0
  if stored(state[2]) == window then
    count = stored(state[3]) or 0
  end
  horizon = (window + 1) * period
  earliest = count < limit and now or horizon
  admitted = {'window', num(window), 'count', count + 1}
else
  return redis.error_reply('unknown rate algorithm ' .. algorithm)
end

local function keep_until(until_us)
  redis.call('PEXPIRE', key, num(math.min(math.ceil((until_us - now + period) / 1000), 2 ^ 53)))
end

if now >= earliest and (reserved or cursor <= now) then
  redis.call('HSET', key, unpack(admitted))
  if reserved then
    redis.call('HDEL', key, reservation)
  end
  if cursor ~= 0 and cursor <= now then
    -- The queue has drained: reservations left by tasks that never came back are dropped.
    local fields = redis.call('HKEYS', key)
    for _, field in ipairs(fields) do
      if string.sub(field, 1, 2) == 'r:' then
        redis.call('HDEL', key, field)
      end
    end
    redis.call('HDEL', key, 'cursor')
    cursor = 0
  end
  keep_until(math.max(horizon, cursor))
  return 0
end

local slot = math.max(cursor, earliest, now)
redis.call('HSET', key, 'cursor', num(slot + emission), reservation, num(slot))
keep_until(math.max(horizon, slot + emission))
return slot - now
