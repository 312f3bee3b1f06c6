-- return_unstarted: put claimed tasks that never started back at the head of pending (or of
-- the suspects list, for a task recovered from a dead consumer before).
-- KEYS[1] processing list of this consumer   KEYS[2] pending list   KEYS[3] recoveries hash
-- KEYS[4] suspects list   KEYS[5] consumer info hash
-- ARGV[1] consumer id   ARGV[2] the returning process's instance token ("": unchecked)
-- ARGV[3..] serialized tasks, in the order they should run
-- Returns: how many were returned (tasks no longer in the processing list are skipped; none if
-- another instance registered the consumer id since: the list is that instance's, see
-- include/settle.lua).
-- include: instance
if other_instance(KEYS[5], ARGV[1], ARGV[2]) then return 0 end
local returned = 0
for i = #ARGV, 3, -1 do
  if redis.call('LREM', KEYS[1], -1, ARGV[i]) > 0 then
    local digest = redis.sha1hex(ARGV[i])
    local suspect = redis.call('HEXISTS', KEYS[3], digest) == 1
    redis.call('HDEL', KEYS[3], 's:' .. digest)  -- it never ran here
    redis.call('RPUSH', suspect and KEYS[4] or KEYS[2], ARGV[i])
    returned = returned + 1
  end
end
return returned
