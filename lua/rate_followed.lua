-- rate_followed: one queue's tasks have followed a changed limit: take it off the list.
-- KEYS[1] the queues whose delayed sets hold tasks with slots of the limiter (hash: queue -> µs of its latest denial)
-- KEYS[2] the queues whose tasks have yet to follow a changed limit (hash: queue -> mode)
-- ARGV[1] the queue   ARGV[2] the mode it was followed in ("slots" or "now")
-- ARGV[3] when the follower began to scan that queue (µs of the server clock)
-- Returns: 1 taken off, 0 left listed (it was listed again, in another mode, meanwhile: a limit
-- removed while its slots were being moved still has its tasks made due now).
-- After "now" the queue holds no task with a slot, unless one was denied since the scan began
-- (a consumer that had not noticed the removal yet): it then stays in KEYS[1], so that consumer's
-- own notice of the removal lists it again.
-- include: args
-- include: key_types
local refused = wrong_key_type({'hash', 'hash'})
if refused then return refused end
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
local denied_at = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
if ARGV[2] == 'now' and denied_at and denied_at < int_arg(ARGV[3], 0, 0, 2 ^ 53) then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
