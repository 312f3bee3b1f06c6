-- retry_later: move a task from this consumer's processing list to the delayed set.
-- KEYS[1] processing list of this consumer   KEYS[2] delayed zset   KEYS[3] recoveries hash
-- ARGV[1] serialized task as claimed   ARGV[2] delayed member ("<%+04d priority><task>")
-- ARGV[3] delay in ms from now (server clock)
-- Returns: 1 moved, 0 lost (no longer in this consumer's list: it was reaped).
-- Errors (before writing anything) if a key holds the wrong type.

-- include: key_types
local refused = wrong_key_type({'list', 'zset', 'hash'})
if refused then return refused end
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then
  return 0
end
-- A deferral (same bytes: rate-limited or disabled, it never ran) keeps the task's recovery
-- count, so a poison pill that is also rate-limited still reaches the dead letters.
local digest = redis.sha1hex(ARGV[1])
if string.sub(ARGV[2], 5) ~= ARGV[1] then
  redis.call('HDEL', KEYS[3], digest, 's:' .. digest)
else
  redis.call('HDEL', KEYS[3], 's:' .. digest)
end
-- include: args
local now_ms = server_now_ms()
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[2])
return 1
