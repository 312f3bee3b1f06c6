-- enqueue_one: push one task and write its waiting mark or its READY record, in one call
-- instead of two.
-- KEYS[1] pending list   KEYS[2] the waiting marks' bucket hash of the task's id, or its result hash
-- ARGV[1] serialized task (priority 0, due now)   ARGV[2] 0 for a mark, else the READY record's time
-- to live (s); then field/value pairs: the mark's one (docs/PROTOCOL.md, "Waiting marks"), or the
-- record's
-- Returns: the length of pending after the push.
-- The keys lie in different Redis Cluster slots: used on a single Redis server only.
-- Atomic: the push comes first (if Redis is out of memory it fails and nothing is written); the
-- mark or record is written with pcall (a record a producer wrote as another type only loses it).

local length = redis.call('LPUSH', KEYS[1], ARGV[1])
if #ARGV >= 4 then
  local ttl_s = tonumber(ARGV[2]) or 0
  local last = #ARGV - ((#ARGV - 2) % 2)
  if type(redis.pcall('HSET', KEYS[2], unpack(ARGV, 3, last))) == 'number' and ttl_s > 0 then
    redis.pcall('EXPIRE', KEYS[2], math.floor(ttl_s))
  end
end
return length
