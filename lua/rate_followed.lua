-- rate_followed: one queue's tasks have followed a changed limit: take it off the list.
-- KEYS[1] the limiter's rate hash (its reservations: `cursor` and `r:<task id>`)
-- KEYS[2] the queues whose delayed sets hold tasks with slots of the limiter (hash: queue -> µs of its latest denial)
-- KEYS[3] the queues whose tasks have yet to follow a changed limit (hash: queue -> mode)
-- ARGV[1] the queue   ARGV[2] the mode it was followed in ("slots" or "now")
-- ARGV[3] when the follower began to scan that queue (µs of the server clock)
-- Returns: 1 taken off, 0 left listed (it was listed again, in another mode, meanwhile: a limit
-- removed while its slots were being moved still has its tasks made due now).
-- After "now" the queue holds no task with a slot, unless one was denied since the scan began
-- (a consumer that had not noticed the removal yet): it then stays in KEYS[2], so that consumer's
-- own notice of the removal lists it again. Once no queue is left in either hash, no task waits
-- for a slot: the reservations are dropped, so that the limit, set again, queues no newcomer
-- behind slots nobody comes back for (the algorithm's own state, tat or window, stays).
-- include: args
local limiter, queues, follow_ups = KEYS[1], KEYS[2], KEYS[3]
if redis.call('HGET', follow_ups, ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', follow_ups, ARGV[1])
if ARGV[2] ~= 'now' then return 1 end
local denied_at = tonumber(redis.call('HGET', queues, ARGV[1]))
if not denied_at or denied_at < int_arg(ARGV[3], 0, 0, 2 ^ 53) then
  redis.call('HDEL', queues, ARGV[1])
end
if redis.call('HLEN', follow_ups) == 0 and redis.call('HLEN', queues) == 0 then
  for _, field in ipairs(redis.call('HKEYS', limiter)) do
    if field == 'cursor' or string.sub(field, 1, 2) == 'r:' then redis.call('HDEL', limiter, field) end
  end
end
return 1
