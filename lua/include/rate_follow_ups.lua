-- Listing the queues whose deferred tasks follow a changed (`slots`) or removed (`now`) limit.
-- Every queue a denial recorded in `queues`, and the type's own queue `own_queue` while slots
-- are reserved (cursor in the future): tasks denied before denials recorded their queue wait
-- there. The list expires with the limiter, even if nobody follows it up.
local function list_follow_ups(limiter, queues, follow_ups, own_queue, mode)
  for _, queue in ipairs(redis.call('HKEYS', queues)) do
    redis.call('HSET', follow_ups, queue, mode)
  end
  local cursor = tonumber(redis.call('HGET', limiter, 'cursor'))
  if own_queue ~= '' and cursor and cursor > server_now_us() then
    redis.call('HSET', follow_ups, own_queue, mode)
  end
  local ttl = redis.call('PTTL', limiter)
  if ttl > 0 then redis.call('PEXPIRE', follow_ups, ttl) end
end
