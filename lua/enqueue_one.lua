-- enqueue_one: write one task's READY record, push the task and add it to its queue's history
-- index, in one call instead of several.
-- KEYS[1] result hash   KEYS[2] pending list; if ARGV[3] > 0, KEYS[3] history zset, KEYS[4]
-- history ids zset, then KEYS[5] to KEYS[4 + ARGV[3]] the status indexes of the statuses named
-- in ARGV[6...]
-- ARGV[1] time to live of the record and the index (s)   ARGV[2] serialized task (priority 0,
-- due now)   ARGV[3] s, the number of status indexes (0: no history index)   ARGV[4] the task id
-- ARGV[5] at most how many tasks the history keeps   ARGV[6] to ARGV[5 + s] the status names;
-- then the record's field/value pairs.
-- Returns: the length of pending after the push.
-- The keys lie in different Redis Cluster slots: used on a single Redis server only.
-- Atomic: the push comes first (if Redis is out of memory it fails and nothing is written);
-- the record and the index are written with pcall (a record a producer wrote as another
-- type only loses it).

-- include: args
-- include: history
local length = redis.call('LPUSH', KEYS[2], ARGV[2])
local ttl_s = int_arg(ARGV[1], 1, 1, 2 ^ 53)
local indexes = int_arg(ARGV[3], 0, 0, math.max(0, #KEYS - 4))
local first = 6 + indexes
if #ARGV >= first + 1 then
  local last = #ARGV - ((#ARGV - first + 1) % 2)
  if type(redis.pcall('HSET', KEYS[1], unpack(ARGV, first, last))) == 'number' then
    redis.pcall('EXPIRE', KEYS[1], ttl_s)
  end
end
if indexes > 0 and ARGV[4] then
  local h = history_keys(KEYS[3], KEYS[4], {unpack(ARGV, 6, 5 + indexes)}, 5)
  history_enqueued(h, {ARGV[4]}, int_arg(ARGV[5], 100000, 1, 2 ^ 53), ttl_s * 1000)
end
return length
