-- dead_letter: move a task from this consumer's processing list to the dead-letter set, and
-- free the uniqueness key its end frees (unique_until = finished) if it was still there.
-- KEYS[1] processing list of this consumer   KEYS[2] dead zset   KEYS[3] recoveries hash
-- KEYS[4] consumer info hash   KEYS[5] (optional) uniqueness key to free
-- ARGV[1] serialized task as claimed   ARGV[2] serialized task with its error and reason
-- ARGV[3] consumer id   ARGV[4] the settling process's instance token ("": unchecked)
-- ARGV[5] (with KEYS[5]) the task's id   ARGV[6] ms from now to free the key in (0: now; see
-- include/unique.lua)
-- Returns: 1 moved, 0 lost (no longer in this consumer's list: it was reaped, or another
-- instance registered the consumer id since, see include/settle.lua; a key it held is left
-- alone, it may be a later run's now).
-- Dead members are scored by the time (ms) they died.

-- include: args
-- include: settle
-- include: unique
-- include: instance
redis.call('HLEN', KEYS[3]); redis.call('ZCARD', KEYS[2])  -- types checked before the task leaves
if other_instance(KEYS[4], ARGV[3], ARGV[4]) or settle_claimed(ARGV[1], KEYS[3], false) == 0 then return 0 end
redis.call('ZADD', KEYS[2], server_now_ms(), ARGV[2])
if KEYS[5] and ARGV[5] then free_unique(KEYS[5], ARGV[5], ARGV[6]) end
return 1
