-- return_unstarted: put claimed tasks that never started back where they wait first (see
-- include/put_back.lua: the head of pending, or first among their priority in prioritized), or
-- at the head of the suspects list, for a task recovered from a dead consumer before.
-- KEYS[1] processing (or staging) list of this consumer   KEYS[2] pending list   KEYS[3] recoveries hash
-- KEYS[4] suspects list   KEYS[5] consumer info hash   KEYS[6] prioritized zset
-- ARGV[1] consumer id   ARGV[2] the returning process's instance token ("": unchecked)
-- ARGV[3] wake token (pushed if a task went to prioritized while pending is empty)
-- ARGV[4..] serialized tasks, in the order they should run
-- Returns: how many were returned (tasks no longer in the processing list are skipped; none if
-- another instance registered the consumer id since: the list is that instance's, see
-- include/settle.lua). The destinations' types are checked before the first task leaves the
-- list, so a key of the wrong type stops the script before a task moved.
-- include: instance
-- include: args
-- include: priority
-- include: protobuf
-- include: put_back
if other_instance(KEYS[5], ARGV[1], ARGV[2]) then return 0 end
redis.call('HLEN', KEYS[3]); redis.call('LLEN', KEYS[2]); redis.call('LLEN', KEYS[4]); redis.call('ZCARD', KEYS[6])
local returned = 0
local prioritized = false
for i = #ARGV, 4, -1 do
  if redis.call('LREM', KEYS[1], -1, ARGV[i]) > 0 then
    local digest = redis.sha1hex(ARGV[i])
    redis.call('HDEL', KEYS[3], 's:' .. digest)  -- it never ran here
    if redis.call('HEXISTS', KEYS[3], digest) == 1 then
      redis.call('RPUSH', KEYS[4], ARGV[i])
    elseif put_back(KEYS[2], KEYS[6], ARGV[i]) then
      prioritized = true
    end
    returned = returned + 1
  end
end
wake_if_needed(KEYS[2], prioritized, ARGV[3])
return returned
