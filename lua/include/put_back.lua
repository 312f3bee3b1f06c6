-- Putting back a claimed task that never started (return_unstarted, deregister) where its priority
-- (field 5 of its envelope) puts it, ahead of every task of that priority waiting, so it keeps its
-- place before those enqueued after it: priority 0 at the head of pending, any other first in its
-- band of prioritized. Bytes that are not a protobuf message (an outside producer's) go to pending.
-- Needs the args, priority and protobuf includes before it.
local function put_back(pending, prioritized, task)
  local priority = clamp_priority(int32_field(task, 5) or 0)
  if priority == 0 then
    redis.call('RPUSH', pending, task)
    return false
  end
  local band = priority_score(priority, 0)
  local first = redis.call('ZRANGE', prioritized, band, '(' .. (band + PRIORITY_BAND), 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  local score = first[2] and math.max(band, tonumber(first[2]) - 1) or priority_score(priority, server_now_ms())
  redis.call('ZADD', prioritized, score, task)
  return true
end

-- After tasks went back: a consumer with nothing to do blocks on pending only, so a task put in
-- prioritized while pending is empty leaves the wake token there.
local function wake_if_needed(pending, prioritized_any, wake_token)
  if prioritized_any and redis.call('LLEN', pending) == 0 then
    redis.call('LPUSH', pending, wake_token)
  end
end
