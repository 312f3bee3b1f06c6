-- rate_removed: a limiter of a type (its unkeyed one, or one key value's) was removed: list every
-- queue holding tasks with slots of it as one whose tasks are due now.
-- KEYS[1] the limiter's rate hash (its `cursor`: the end of the queue of reserved slots)
-- KEYS[2] the queues whose delayed sets hold tasks with slots of the limiter (hash: queue -> µs of its latest denial)
-- KEYS[3] the queues whose tasks have yet to follow a changed limit (hash: queue -> mode)
-- ARGV[1] the type's own queue: listed too while slots are reserved, for tasks denied before
--         denials recorded their queue in KEYS[2]
-- Returns: how many queues are left to follow. Calling it again (every consumer notices the
-- removal) lists only the queues not yet done: a queue done is gone from KEYS[2], and once none
-- is left the reservations are gone from KEYS[1] (rate_followed).
-- include: args
-- include: rate_follow_ups
list_follow_ups(KEYS[1], KEYS[2], KEYS[3], ARGV[1], 'now')
return redis.call('HLEN', KEYS[3])
