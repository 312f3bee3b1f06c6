-- wake_enabled: make due now the tasks of a type that were deferred while it was disabled (noted by
-- note_disabled.lua), now that it is enabled; a batch per call.
-- KEYS[1] the queue's disabled types set   KEYS[2] that type's deferred members set   KEYS[3] the
-- queue's delayed zset
-- ARGV[1] the task type   ARGV[2] at most how many members to take
-- A member taken that is no longer delayed (promoted at its recheck, claimed, cancelled) is not
-- added back (ZADD XX). Once the type's set is empty its name leaves the disabled types set.
-- Returns: {members taken, tasks made due}. The delayed set's type is checked before the pop.

-- include: args
redis.call('ZCARD', KEYS[3])
local taken = redis.call('SPOP', KEYS[2], int_arg(ARGV[2], 1000, 1, 100000))
local now_ms = server_now_ms()
local due = 0
for _, member in ipairs(taken) do
  due = due + redis.call('ZADD', KEYS[3], 'XX', 'CH', now_ms, member)
end
if redis.call('SCARD', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[1], ARGV[1])
end
return {#taken, due}
