-- trim_dead: drop the oldest dead letters beyond a count and those older than an age, a batch at a time.
-- KEYS[1] dead zset (score = time of death, ms)
-- ARGV[1] most dead letters kept   ARGV[2] longest kept (ms)   ARGV[3] most dropped by this call
-- Returns: how many were dropped (the batch size when there may be more to drop: call again).
-- Cost: O(log n) when there is nothing to drop, plus O(log n) per dropped member; a set far over
-- its caps is trimmed in several calls, so no call holds Redis for long.

-- include: args
local max_count = int_arg(ARGV[1], 10000, 0, 2 ^ 53)
local max_age_ms = int_arg(ARGV[2], 15552000000, 0, 2 ^ 53)
local batch = int_arg(ARGV[3], 10000, 1, 2 ^ 53)
-- An empty set, what most queues have, costs one read.
local count = redis.call('ZCARD', KEYS[1])
if count == 0 then return 0 end
-- Both caps drop the oldest first, so the members to drop are the lowest ranks.
local too_old = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. string.format('%.0f', server_now_ms() - max_age_ms))
local excess = count - max_count
local drop = math.min(math.max(too_old, excess), batch)
if drop <= 0 then return 0 end
return redis.call('ZREMRANGEBYRANK', KEYS[1], 0, drop - 1)
