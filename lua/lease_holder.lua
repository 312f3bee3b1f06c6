-- lease_holder: who holds a consumer id's lease on one queue, and for how long yet (server clock).
-- KEYS[1] consumers zset (id -> lease deadline ms)   KEYS[2] consumer info hash (id -> JSON)
-- ARGV[1] consumer id
-- Returns: {1, ms left on its lease (0 or less once it lapsed), info JSON ("" if none)}, or
-- {0, 0, ""} when the id holds no lease entry on this queue.
-- include: args
local deadline = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
if not deadline then
  return {0, 0, ''}
end
return {1, deadline - server_now_ms(), redis.call('HGET', KEYS[2], ARGV[1]) or ''}
