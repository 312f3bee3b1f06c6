-- record_ready: write the READY result records of tasks being enqueued, each with a time to live.
-- KEYS[1], KEYS[2], ... the result hashes, one per task
-- ARGV[1] time to live (s); then one group per run of KEYS that share their fields: the number
-- of keys in the run, the number of field/value pairs p, then the p pairs.
-- Returns: the number of records written.
-- One call writes a whole batch: a bulk enqueue of identical tasks sends their fields once.
local ttl = ARGV[1]
local key, at = 1, 2
while at <= #ARGV do
  local count, last = tonumber(ARGV[at]), at + 1 + 2 * tonumber(ARGV[at + 1])
  for i = key, key + count - 1 do
    redis.call('HSET', KEYS[i], unpack(ARGV, at + 2, last))
    redis.call('EXPIRE', KEYS[i], ttl)
  end
  key, at = key + count, last + 1
end
return key - 1
