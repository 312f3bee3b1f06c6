-- deregister: a consumer leaving cleanly gives back what it holds and drops its lease.
-- KEYS[1] consumers zset   KEYS[2] consumer info hash   KEYS[3] processing list   KEYS[4] pending
-- KEYS[5] recoveries hash   KEYS[6] suspects list (for tasks recovered from a dead consumer before)
-- KEYS[7] prioritized zset
-- ARGV[1] consumer id   ARGV[2] the leaving process's instance token ("": unchecked)
-- ARGV[3] wake token (pushed if a task went to prioritized while pending is empty)
-- Returns: how many tasks went back where they wait first (see include/put_back.lua: the head of
-- pending, or first among their priority in prioritized; oldest claimed runs first), or -1
-- when the registered info names another instance (another process registered this id since:
-- its list and lease are left alone). A returned suspect goes to the head of suspects and loses
-- its start mark: it did not die here, and counts only if it dies running again. Only a clean
-- exit calls this; a new run recovers an unclean one's list with reap. A key of another type than
-- these (a foreign writer's) is a WRONGTYPE error naming it before any write: no task leaves the
-- list to be lost halfway.
-- include: instance
-- include: args
-- include: key_types
local refused = wrong_key_type({'zset', 'hash', 'list', 'list', 'hash', 'list', 'zset'})
if refused then return refused end
-- include: priority
-- include: protobuf
-- include: put_back
if other_instance(KEYS[2], ARGV[1], ARGV[2]) then
  return -1
end
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
