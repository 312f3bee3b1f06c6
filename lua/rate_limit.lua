-- rate_limit: decide whether one task of a rate-limited type may start now (Redis server clock).
-- KEYS[1] the type's rate hash. Fields: tat (GCRA theoretical arrival time), window + count
--         (fixed window), cursor (end of the queue of reserved slots), r:<task id> (a slot
--         reserved for a task that was denied). All times are microseconds of the server clock.
-- KEYS[2] the queues whose delayed sets hold tasks with such slots (hash: queue -> µs of its latest denial)
-- KEYS[3] the queues whose tasks have yet to follow a changed limit (hash: queue -> "slots")
-- ARGV[1] algorithm: "gcra" or "fixed_window"
-- ARGV[2] task id, or "" to only bring the hash to this spacing (no decision: replies {0, rescaled})
-- ARGV[3] limit: starts per period (fixed_window)
-- ARGV[4] period in microseconds
-- ARGV[5] emission interval in microseconds: GCRA's increment, and the spacing of reserved slots
-- ARGV[6] GCRA tolerance in microseconds: how long before its theoretical arrival time a start
--         is admitted (gcra only)
-- ARGV[7] the task's queue (where a denied task waits; "" with no task id)
-- ARGV[8] the type's own queue, listed with the queues of KEYS[2] when the slots are rescaled
-- Returns: {wait, rescaled}: wait 0 when the task may start now, else the microseconds until its
-- reserved slot; rescaled 1 when this call found the hash written under another emission interval
-- (the type's limit was changed) and moved its future times to the new spacing, else 0.
-- An argument that is not a number falls back to a default (limit 1, period 1 s, emission one
-- period, tolerance 0). Times past 2^53 µs are legitimate: a slow type's long backlog reserves
-- slots centuries out.
--
-- A denied task is given the next free slot of a queue spaced by the emission interval, so
-- denied tasks wake one by one instead of all at once. While that queue is not empty, only
-- tasks holding a reservation may start; a newcomer joins the end of the queue. A reserved task
-- that comes back before its slot (a stricter limit moved the slot later) keeps it.
--
-- The hash remembers the emission interval it was written under (field emission). A call under
-- another one (the limit, period, burst or algorithm changed) first moves every future time it
-- holds (tat, cursor, the reservations) to the new spacing, counted from now: a raised limit
-- brings waiting tasks' slots closer, a lowered one spreads them out, and their order is kept.
-- Every queue holding such tasks is then listed in KEYS[3], for a consumer to bring them there.
-- include: args
-- include: rate_follow_ups
local now = server_now_us()
local key, queues, follow_ups = KEYS[1], KEYS[2], KEYS[3]
local algorithm = ARGV[1]
local reservation = 'r:' .. ARGV[2]
local limit = int_arg(ARGV[3], 1, 1, 2 ^ 53)
local period = int_arg(ARGV[4], 1000000, 1, 2 ^ 53)
local emission = int_arg(ARGV[5], period, 1, 2 ^ 53)
local tolerance = int_arg(ARGV[6], 0, 0, 2 ^ 53)

-- Numbers go to Redis as integer text: Lua's own conversion writes 1e+14 past 14 digits.
local function num(value)
  return string.format('%.0f', value)
end

-- Move the hash's future times from the spacing `old` to `emission`, counted from now.
local function rescale(old)
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local name, value = fields[i], stored_int(fields[i + 1])
    if value and value > now and (name == 'tat' or name == 'cursor' or string.sub(name, 1, 2) == 'r:') then
      redis.call('HSET', key, name, num(now + math.floor((value - now) * emission / old)))
    end
  end
  list_follow_ups(key, queues, follow_ups, ARGV[8], 'slots')
end

local rescaled = 0
local written_under = stored_int(redis.call('HGET', key, 'emission'))
if written_under and written_under > 0 and written_under ~= emission then
  rescale(written_under)
  rescaled = 1
end
if ARGV[2] == '' then
  if redis.call('EXISTS', key) == 1 then redis.call('HSET', key, 'emission', num(emission)) end
  return {0, rescaled}
end
redis.call('HSET', key, 'emission', num(emission))

local state = redis.call('HMGET', key, 'tat', 'window', 'count', 'cursor', reservation)
local cursor = stored_int(state[4]) or 0
local reserved = state[5] ~= false
local reserved_slot = stored_int(state[5])

-- The earliest time the algorithm admits a start, and the fields an admission now would write.
local earliest, admitted, horizon
if algorithm == 'gcra' then
  local tat = stored_int(state[1]) or now
  earliest = tat - tolerance
  horizon = math.max(tat, now) + emission
  admitted = {'tat', num(horizon)}
elseif algorithm == 'fixed_window' then
  local window = math.floor(now / period)
  local count = 0
  if stored_int(state[2]) == window then
    count = stored_int(state[3]) or 0
  end
  horizon = (window + 1) * period
  earliest = count < limit and now or horizon
  admitted = {'window', num(window), 'count', count + 1}
else
  return redis.error_reply('unknown rate algorithm ' .. algorithm)
end

local function keep_until(until_us)
  local ms = num(math.min(math.ceil((until_us - now + period) / 1000), 2 ^ 53))
  -- Not the list of queues to follow: one nobody follows up (every consumer that noticed the
  -- change died) expires as listed, and then stops holding the reservations (see below).
  for _, name in ipairs({key, queues}) do redis.call('PEXPIRE', name, ms) end
end

-- A denied task waits in its queue's delayed set: the queue is noted (and when), so that a change
-- of the limit reaches it there.
local function deny(slot, until_us)
  if ARGV[7] ~= '' then redis.call('HSET', queues, ARGV[7], num(now)) end
  keep_until(until_us)
  return {slot - now, rescaled}
end

if reserved_slot and reserved_slot - tolerance > now then
  return deny(reserved_slot, math.max(horizon, cursor))  -- back before its slot: it keeps its place
end

if now >= earliest and (reserved or cursor <= now) then
  redis.call('HSET', key, unpack(admitted))
  if reserved then
    redis.call('HDEL', key, reservation)
  end
  if cursor ~= 0 and cursor <= now and redis.call('HLEN', follow_ups) == 0 then
    -- The queue has drained: reservations left by tasks that never came back are dropped. Not
    -- while queues are listed for a follow-up: their tasks may wait past slots a raised limit
    -- moved closer, and the follow-up finds them by their reservations.
    local fields = redis.call('HKEYS', key)
    for _, field in ipairs(fields) do
      if string.sub(field, 1, 2) == 'r:' then
        redis.call('HDEL', key, field)
      end
    end
    redis.call('HDEL', key, 'cursor')
    redis.call('DEL', queues, follow_ups)
    cursor = 0
  end
  keep_until(math.max(horizon, cursor))
  return {0, rescaled}
end

local slot = math.max(cursor, earliest, now)
redis.call('HSET', key, 'cursor', num(slot + emission), reservation, num(slot))
return deny(slot, math.max(horizon, slot + emission))
