-- rate_followed: one queue's tasks have followed a changed limit: take it off the list.
-- KEYS[1] the queues whose delayed sets hold tasks with slots of the limiter (set)
-- KEYS[2] the queues whose tasks have yet to follow a changed limit (hash: queue -> mode)
-- ARGV[1] the queue   ARGV[2] the mode it was followed in ("slots" or "now")
-- Returns: 1 taken off, 0 left listed (it was listed again, in another mode, meanwhile: a limit
-- removed while its slots were being moved still has its tasks made due now).
-- include: key_types
local refused = wrong_key_type({'set', 'hash'})
if refused then return refused end
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[2] == 'now' then  -- none of its tasks holds a slot any more
  redis.call('SREM', KEYS[1], ARGV[1])
end
return 1
