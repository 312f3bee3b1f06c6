-- deregister: a consumer leaving cleanly gives back what it holds and drops its lease.
-- KEYS[1] consumers zset   KEYS[2] consumer info hash   KEYS[3] processing list   KEYS[4] pending
-- KEYS[5] recoveries hash   KEYS[6] suspects list (for tasks recovered from a dead consumer before)
-- ARGV[1] consumer id   ARGV[2] (optional) the leaving process's instance token
-- Returns: how many tasks went back to the head of pending (oldest claimed runs first), or -1
-- when the registered info names another instance (another process registered this id since:
-- its list and lease are left alone). A returned suspect loses its start mark: it did not die
-- here, and counts only if it dies running again. Only a clean exit calls this; a new run
-- recovers an unclean one's list with reap.
-- include: instance
if other_instance(KEYS[2], ARGV[1], ARGV[2]) then
  return -1
end
local returned = 0
while true do
  local task = redis.call('LPOP', KEYS[3])
  if not task then break end
  local digest = redis.sha1hex(task)
  local suspect = redis.call('HEXISTS', KEYS[5], digest) == 1
  redis.call('HDEL', KEYS[5], 's:' .. digest)
  redis.call('RPUSH', suspect and KEYS[6] or KEYS[4], task)
  returned = returned + 1
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return returned
