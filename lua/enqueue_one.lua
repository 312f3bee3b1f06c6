-- enqueue_one: write one task's READY record and push the task, in one call instead of two.
-- KEYS[1] result hash   KEYS[2] pending list
-- ARGV[1] time to live of the record (s)   ARGV[2] serialized task (priority 0, due now); then
-- the record's field/value pairs.
-- Returns: the length of pending after the push.
-- The two keys lie in different Redis Cluster slots: used on a single Redis server only.
-- Atomic: the push comes first (if Redis is out of memory it fails and nothing is written);
-- the record is written with pcall (a result key of a foreign type only loses its record).

-- include: args
local length = redis.call('LPUSH', KEYS[2], ARGV[2])
if #ARGV >= 4 and type(redis.pcall('HSET', KEYS[1], unpack(ARGV, 3, #ARGV - (#ARGV % 2)))) == 'number' then
  redis.pcall('EXPIRE', KEYS[1], int_arg(ARGV[1], 1, 1, 2 ^ 53))
end
return length
