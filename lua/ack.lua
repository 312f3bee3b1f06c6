-- ack: finish tasks this consumer ran, if they are still in its processing list.
-- KEYS[1] processing list of this consumer   KEYS[2] recoveries hash
-- KEYS[3] (optional) this 10-second bucket's completed counter, incremented by the tasks acked
-- ARGV[1..n] serialized tasks
-- Returns: one flag per task: 1 acknowledged, 0 lost (reaped or finished elsewhere).
-- Errors (before writing anything) if a key holds the wrong type.
-- Cost: O(this consumer's in-flight) per task, independent of other consumers.

-- include: key_types
-- include: settle
local refused = wrong_key_type({'list', 'hash', 'string'})
if refused then return refused end
local flags = {}
local acked = 0
for i, task in ipairs(ARGV) do
  flags[i] = settle_claimed(task, KEYS[2], false)
  acked = acked + flags[i]
end
if KEYS[3] and acked > 0 then
  redis.call('INCRBY', KEYS[3], acked)
  redis.call('EXPIRE', KEYS[3], 120)
end
return flags
