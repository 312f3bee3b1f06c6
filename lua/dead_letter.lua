-- dead_letter: move a task from this consumer's processing list to the dead-letter set.
-- KEYS[1] processing list of this consumer   KEYS[2] dead zset   KEYS[3] recoveries hash
-- ARGV[1] serialized task as claimed   ARGV[2] serialized task with its error and reason
-- Returns: 1 moved, 0 lost (no longer in this consumer's list: it was reaped).
-- Errors (before writing anything) if a key holds the wrong type.
-- Dead members are scored by the time (ms) they died.
-- Refuse before any write if a key holds another type (a foreign writer's mistake): an error
-- halfway would leave the task removed from the processing list and nowhere else.
for i, want in ipairs({'list', 'zset', 'hash'}) do
  local kind = KEYS[i] and redis.call('TYPE', KEYS[i]).ok
  if kind and kind ~= 'none' and kind ~= want then
    return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' holds a ' .. kind .. ', not a ' .. want)
  end
end
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then
  return 0
end
local digest = redis.sha1hex(ARGV[1])
redis.call('HDEL', KEYS[3], digest, 's:' .. digest)
local time = redis.call('TIME')
redis.call('ZADD', KEYS[2], tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000), ARGV[2])
return 1
