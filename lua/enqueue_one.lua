-- enqueue_one: write one task's READY record and push the task, in one call instead of two.
-- KEYS[1] result hash   KEYS[2] pending list
-- ARGV[1] time to live of the record (s)   ARGV[2] serialized task (priority 0, due now); then
-- the record's field/value pairs.
-- Returns: the length of pending after the push.
-- The two keys lie in different Redis Cluster slots: used on a single Redis server only.
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('LPUSH', KEYS[2], ARGV[2])
