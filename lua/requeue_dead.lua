-- requeue_dead: move dead-lettered tasks back to pending (priority 0) or prioritized (other).
-- KEYS[1] dead zset   KEYS[2] pending list   KEYS[3] prioritized zset   KEYS[4] cancel requests
-- zset   KEYS[5] forced cancels zset
-- ARGV[1] wake token; then quadruples: ARGV[4k-2] dead member as stored, ARGV[4k-1] priority
-- (-100..100; anything else is clamped, a non-number is 0), ARGV[4k] task to push (re-encoded
-- for a fresh start), ARGV[4k+1] its id (its cancel requests are dropped: the new run starts afresh)
-- Returns: one flag per quadruple, 1 requeued, 0 skipped (no longer dead: requeued by someone
-- else, deleted or trimmed meanwhile; nothing is written for it).

-- include: args
-- include: priority
local now_ms = server_now_ms()
local requeued = {}
local woke = false
for i = 2, #ARGV - 3, 4 do
  local moved = redis.call('ZREM', KEYS[1], ARGV[i])
  if moved > 0 then
    redis.call('ZREM', KEYS[4], ARGV[i + 3])
    redis.call('ZREM', KEYS[5], ARGV[i + 3])
    local priority = int_arg(ARGV[i + 1], 0, -100, 100)
    if priority == 0 then
      redis.call('LPUSH', KEYS[2], ARGV[i + 2])
    else
      redis.call('ZADD', KEYS[3], priority_score(priority, now_ms), ARGV[i + 2])
      woke = true
    end
  end
  requeued[#requeued + 1] = moved
end
-- A consumer with nothing to do blocks on the pending list only: a token there wakes it.
if woke and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return requeued
