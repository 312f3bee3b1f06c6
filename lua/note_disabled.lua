-- note_disabled: remember a task deferred because its type is disabled, so that it is made due at
-- once when the type is enabled again (wake_enabled.lua), not only at its recheck.
-- KEYS[1] the queue's disabled types set (type names)   KEYS[2] that type's deferred members set
-- (delayed members, as in the delayed zset)
-- ARGV[1] the task type   ARGV[2] the task's delayed member   ARGV[3] time to live of both keys (ms)
-- Both keys expire ARGV[3] after the last note: a note lost or expired costs only the wait until
-- the task's recheck, when its consumer sees the type enabled.
-- Returns: 1.

-- include: args
local ttl_ms = int_arg(ARGV[3], 600000, 1, 2 ^ 53)
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ttl_ms)
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return 1
