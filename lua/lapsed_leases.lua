-- lapsed_leases: how many consumers' leases lapsed within a window, from the lease index.
-- KEYS[1] the lease index zset (consumer id -> its latest lease deadline ms, written by heartbeat)
-- ARGV[1] the window (ms)   ARGV[2] how long a lapsed entry is kept (ms)
-- Returns: how many deadlines lie in [now - window, now). Idle, with no lapsed entry, it is one
-- read; entries lapsed longer than they are kept are dropped.
-- include: args
local now_ms = server_now_ms()
local first = redis.call('ZRANGE', KEYS[1], '-inf', '(' .. now_ms, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
if #first == 0 then return 0 end
local kept_from_ms = now_ms - int_arg(ARGV[2], 86400000, 0, 2 ^ 53)
if tonumber(first[2]) < kept_from_ms then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. kept_from_ms)
end
return redis.call('ZCOUNT', KEYS[1], now_ms - int_arg(ARGV[1], 0, 0, 2 ^ 53), '(' .. now_ms)
