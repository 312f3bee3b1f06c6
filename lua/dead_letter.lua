-- dead_letter: move a task from this consumer's processing list to the dead-letter set.
-- KEYS[1] processing list of this consumer   KEYS[2] dead zset   KEYS[3] recoveries hash
-- ARGV[1] serialized task as claimed   ARGV[2] serialized task with its error and reason
-- Returns: 1 moved, 0 lost (no longer in this consumer's list: it was reaped).
-- Errors (before writing anything) if a key holds the wrong type.
-- Dead members are scored by the time (ms) they died.

-- include: key_types
local refused = wrong_key_type({'list', 'zset', 'hash'})
if refused then return refused end
if redis.call('LREM', KEYS[1], -1, ARGV[1]) == 0 then
  return 0
end
local digest = redis.sha1hex(ARGV[1])
redis.call('HDEL', KEYS[3], digest, 's:' .. digest)
-- include: args
redis.call('ZADD', KEYS[2], server_now_ms(), ARGV[2])
return 1
