-- enqueue_prioritized: add tasks with a non-zero priority, waking a consumer blocked on pending.
-- KEYS[1] prioritized zset   KEYS[2] pending list
-- ARGV[1] wake token; then pairs: ARGV[2k] priority (-100..100), ARGV[2k+1] serialized task
-- Returns: the number of tasks added.
-- Score (100 - priority) * 2^42 + server ms: higher priority first, then first come first served.
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local added = 0
for i = 2, #ARGV, 2 do
  local score = (100 - tonumber(ARGV[i])) * 4398046511104 + now_ms
  added = added + redis.call('ZADD', KEYS[1], score, ARGV[i + 1])
end
-- A consumer with nothing to do blocks on the pending list only: a token there wakes it.
if redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return added
