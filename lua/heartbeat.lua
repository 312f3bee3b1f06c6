-- heartbeat: register a consumer or renew its lease, on the server's clock.
-- KEYS[1] consumers zset (id -> lease deadline ms)   KEYS[2] consumer info hash (id -> JSON)
-- ARGV[1] consumer id   ARGV[2] lease ms   ARGV[3] info JSON to register with, or "" to renew
-- Returns: 1 lease held, 0 lease lost (the consumer was reaped and must not use this id again).
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
elseif not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
return 1
