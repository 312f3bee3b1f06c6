-- reap_candidates: consumers whose lease expired, and reaped ids kept as tombstones.
-- KEYS[1] consumers zset   KEYS[2] reaped zset (id -> time reaped, ms)
-- ARGV[1] max ids   ARGV[2] how long tombstones are kept (ms)
-- Returns: {expired ids..., "", tombstone ids...}
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms - tonumber(ARGV[2]))
local out = redis.call('ZRANGE', KEYS[1], '-inf', '(' .. now_ms, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[1]))
out[#out + 1] = ''
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, tonumber(ARGV[1]) - 1)) do
  out[#out + 1] = id
end
return out
