-- requeue_dead: move dead-lettered tasks back to the tail of pending.
-- KEYS[1] dead zset   KEYS[2] pending list
-- ARGV[1..n] serialized tasks to requeue, each re-encoded for a fresh start; pairs:
-- ARGV[2k-1] dead member as stored, ARGV[2k] task to push
-- Returns: how many were requeued (members no longer dead are skipped).
local requeued = 0
for i = 1, #ARGV, 2 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) > 0 then
    redis.call('LPUSH', KEYS[2], ARGV[i + 1])
    requeued = requeued + 1
  end
end
return requeued
