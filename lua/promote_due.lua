-- promote_due: move delayed tasks whose time has come to pending (or prioritized), in a batch.
-- KEYS[1] delayed zset   KEYS[2] pending list   KEYS[3] prioritized zset   KEYS[4] recoveries
-- hash   KEYS[5] suspects list (where a due task that was recovered before goes back)
-- ARGV[1] max tasks to move   ARGV[2] wake token
-- Delayed members are "<priority as %+04d><serialized task>", scored by due time in ms.
-- Returns: {moved, next due ms or -1, server now ms}
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local due = redis.call('ZRANGE', KEYS[1], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[1]))
local woke = false
local any_suspect = redis.call('HLEN', KEYS[4]) > 0
for _, member in ipairs(due) do
  local priority = tonumber(string.sub(member, 1, 4))
  local task = string.sub(member, 5)
  if any_suspect and redis.call('HEXISTS', KEYS[4], redis.sha1hex(task)) == 1 then
    redis.call('LPUSH', KEYS[5], task)
    woke = true
  elseif priority == 0 then
    redis.call('LPUSH', KEYS[2], task)
  else
    redis.call('ZADD', KEYS[3], (100 - priority) * 4398046511104 + now_ms, task)
    woke = true
  end
  redis.call('ZREM', KEYS[1], member)
end
if woke and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[2])
end
local next_due = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {#due, next_due[2] and tonumber(next_due[2]) or -1, now_ms}
