-- dead_letter: move a task from this consumer's processing list to the dead-letter set.
-- KEYS[1] processing list of this consumer   KEYS[2] dead zset   KEYS[3] recoveries hash
-- ARGV[1] serialized task as claimed   ARGV[2] serialized task with its error and reason
-- Returns: 1 moved, 0 lost (no longer in this consumer's list: it was reaped).
-- Errors (before writing anything) if a key holds the wrong type.
-- Dead members are scored by the time (ms) they died.

-- include: args
-- include: key_types
-- include: settle
local refused = wrong_key_type({'list', 'zset', 'hash'})
if refused then return refused end
if settle_claimed(ARGV[1], KEYS[3], false) == 0 then return 0 end
redis.call('ZADD', KEYS[2], server_now_ms(), ARGV[2])
return 1
