-- mark_waiting: write the waiting marks of a batch's tasks (docs/PROTOCOL.md, "Waiting marks"),
-- one call instead of one HSET per bucket.
-- KEYS[1] to KEYS[n] the bucket hashes of the n marks
-- ARGV[2i-1] the i-th mark's field (8 bytes of sha1(id))   ARGV[2i] its value ("<queue> <type>")
-- Returns: the number of marks written.
-- The buckets lie in different Redis Cluster slots: used on a single Redis server only, in the
-- MULTI of the pushes (on Redis Cluster the producer sends one HSET per mark).

for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[2 * i - 1], ARGV[2 * i])
end
return #KEYS
