-- trim_dead: drop the oldest dead letters beyond a count and those older than an age.
-- KEYS[1] dead zset (score = time of death, ms)
-- ARGV[1] most dead letters kept   ARGV[2] longest kept (ms)
-- Returns: how many were dropped.
-- Cost: O(log n) when there is nothing to drop, plus O(log n) per dropped member.

-- include: args
local max_count = int_arg(ARGV[1], 10000, 0, 2 ^ 53)
local max_age_ms = int_arg(ARGV[2], 15552000000, 0, 2 ^ 53)
local dropped = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.0f', server_now_ms() - max_age_ms))
local excess = redis.call('ZCARD', KEYS[1]) - max_count
if excess > 0 then
  dropped = dropped + redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
end
return dropped
