-- requeue_dead: move dead-lettered tasks back to pending (priority 0) or prioritized (other).
-- KEYS[1] dead zset   KEYS[2] pending list   KEYS[3] prioritized zset
-- ARGV[1] wake token; then triples: ARGV[3k-1] dead member as stored, ARGV[3k] priority
-- (-100..100; anything else is clamped, a non-number is 0), ARGV[3k+1] task to push (re-encoded
-- for a fresh start)
-- Returns: how many were requeued (members no longer dead are skipped).

-- include: args
-- include: priority
local now_ms = server_now_ms()
local requeued = 0
local woke = false
for i = 2, #ARGV - 2, 3 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) > 0 then
    local priority = int_arg(ARGV[i + 1], 0, -100, 100)
    if priority == 0 then
      redis.call('LPUSH', KEYS[2], ARGV[i + 2])
    else
      redis.call('ZADD', KEYS[3], priority_score(priority, now_ms), ARGV[i + 2])
      woke = true
    end
    requeued = requeued + 1
  end
end
-- A consumer with nothing to do blocks on the pending list only: a token there wakes it.
if woke and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return requeued
