-- enqueue_prioritized: add tasks with a non-zero priority, waking a consumer blocked on pending.
-- KEYS[1] prioritized zset   KEYS[2] pending list
-- ARGV[1] wake token; then pairs: ARGV[2k] priority (-100..100; anything else is clamped, a
-- non-number is 0), ARGV[2k+1] serialized task
-- Returns: the number of tasks added.
-- Score (100 - priority) * 2^42 + server ms: higher priority first, then first come first served.

-- include: args
-- include: priority
local now_ms = server_now_ms()
local added = 0
for i = 2, #ARGV - 1, 2 do
  added = added + redis.call('ZADD', KEYS[1], priority_score(int_arg(ARGV[i], 0, -100, 100), now_ms), ARGV[i + 1])
end
-- A consumer with nothing to do blocks on the pending list only: a token there wakes it.
if redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return added
