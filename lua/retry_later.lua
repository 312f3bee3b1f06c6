-- retry_later: move a task from this consumer's processing list to the delayed set.
-- KEYS[1] processing list of this consumer   KEYS[2] delayed zset   KEYS[3] recoveries hash
-- KEYS[4] consumer info hash
-- ARGV[1] serialized task as claimed   ARGV[2] delayed member ("<%+04d priority><task>")
-- ARGV[3] delay in ms from now (server clock; not a number: 0)   ARGV[4] consumer id
-- ARGV[5] the settling process's instance token ("": unchecked)
-- Returns: 1 moved, 0 lost (no longer in this consumer's list: it was reaped; or another
-- instance registered the consumer id since: see include/settle.lua).

-- include: args
-- include: settle
-- include: instance
redis.call('HLEN', KEYS[3]); redis.call('ZCARD', KEYS[2])  -- types checked before the task leaves
if other_instance(KEYS[4], ARGV[4], ARGV[5]) then return 0 end
-- A deferral (same bytes: rate-limited or disabled, it never ran) keeps the task's recovery
-- count, so a poison pill that is also rate-limited still reaches the dead letters.
if settle_claimed(ARGV[1], KEYS[3], string.sub(ARGV[2], 5) == ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], server_now_ms() + int_arg(ARGV[3], 0, 0, 2 ^ 53), ARGV[2])
return 1
