-- enqueue_one: push one task and write its waiting mark, in one call instead of two.
-- KEYS[1] pending list   KEYS[2] the waiting marks' bucket hash of the task's id
-- ARGV[1] serialized task (priority 0, due now)   ARGV[2] the mark's field   ARGV[3] its value
-- (docs/PROTOCOL.md, "Waiting marks")
-- Returns: the length of pending after the push.
-- The keys lie in different Redis Cluster slots: used on a single Redis server only.
-- Atomic: the push comes first (if Redis is out of memory it fails and nothing is written).

local length = redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return length
