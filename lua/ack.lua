-- ack: finish tasks this consumer ran, if they are still in its processing list, and free the
-- uniqueness keys their ends free (unique_until = finished) only for those.
-- KEYS[1] processing list of this consumer   KEYS[2] recoveries hash
-- KEYS[3] this 10-second bucket's completed counter, incremented by the tasks acked
-- KEYS[4] consumer info hash   KEYS[5..4+u] uniqueness keys to free
-- ARGV[1] n, the number of tasks   ARGV[2] consumer id   ARGV[3] the settling process's instance
-- token ("": unchecked)   ARGV[4..3+n] serialized tasks; then per uniqueness key KEYS[4+j]
-- three arguments: the position (1..n) of the task whose ack frees it, that task's id, ms from
-- now to free it in (0: now; see include/unique.lua)
-- Returns: one flag per task: 1 acknowledged, 0 lost (reaped or finished elsewhere: a key it
-- held is left alone, it may be a later run's now; all 0 if another instance registered the
-- consumer id since: the list is that instance's, see include/settle.lua).
-- Cost: O(this consumer's in-flight) per task, independent of other consumers.

-- include: args
-- include: settle
-- include: unique
-- include: instance
local n = int_arg(ARGV[1], 0, 0, #ARGV - 3)
local elsewhere = other_instance(KEYS[4], ARGV[2], ARGV[3])
-- Most often no task of the queue was recovered: no digest to compute, no mark to clear.
local recoveries = redis.call('EXISTS', KEYS[2]) == 1 and KEYS[2]
local flags = {}
local acked = 0
for i = 1, n do
  flags[i] = elsewhere and 0 or settle_claimed(ARGV[3 + i], recoveries, false)
  acked = acked + flags[i]
end
for j = 5, #KEYS do
  local at = 4 + n + 3 * (j - 5)
  if flags[tonumber(ARGV[at]) or 0] == 1 and ARGV[at + 1] then free_unique(KEYS[j], ARGV[at + 1], ARGV[at + 2]) end
end
if acked > 0 then
  redis.call('INCRBY', KEYS[3], acked)
  redis.call('EXPIRE', KEYS[3], 120)
end
return flags
