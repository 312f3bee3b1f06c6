-- deregister: a consumer leaving cleanly gives back what it holds and drops its lease.
-- KEYS[1] consumers zset   KEYS[2] consumer info hash   KEYS[3] processing list   KEYS[4] pending
-- KEYS[5] recoveries hash   KEYS[6] suspects list (for tasks recovered from a dead consumer before)
-- KEYS[7] prioritized zset   KEYS[8] staging list (see claim_staged.lua: its tasks go back too)
-- ARGV[1] consumer id   ARGV[2] the leaving process's instance token ("": unchecked)
-- ARGV[3] wake token (pushed if a task went to prioritized while pending is empty)
-- Returns: how many tasks went back where they wait first (see include/put_back.lua: the head of
-- pending, or first among their priority in prioritized; oldest claimed runs first), or -1
-- when the registered info names another instance (another process registered this id since:
-- its list and lease are left alone). A returned suspect goes to the head of suspects and loses
-- its start mark: it did not die here, and counts only if it dies running again. Only a clean
-- exit calls this; a new run recovers an unclean one's list with reap. The destinations' types
-- are checked before the first task leaves the list, so a key of the wrong type moves nothing.
-- include: instance
-- include: args
-- include: priority
-- include: protobuf
-- include: put_back
if other_instance(KEYS[2], ARGV[1], ARGV[2]) then
  return -1
end
redis.call('HLEN', KEYS[5]); redis.call('LLEN', KEYS[4]); redis.call('LLEN', KEYS[6]); redis.call('ZCARD', KEYS[7])
redis.call('LLEN', KEYS[3])
while redis.call('RPOPLPUSH', KEYS[8], KEYS[3]) do end
local returned = 0
local prioritized = false
while true do
  local task = redis.call('LPOP', KEYS[3])
  if not task then break end
  local digest = redis.sha1hex(task)
  redis.call('HDEL', KEYS[5], 's:' .. digest)
  if redis.call('HEXISTS', KEYS[5], digest) == 1 then
    redis.call('RPUSH', KEYS[6], task)
  elseif put_back(KEYS[4], KEYS[7], task) then
    prioritized = true
  end
  returned = returned + 1
end
wake_if_needed(KEYS[4], prioritized, ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return returned
