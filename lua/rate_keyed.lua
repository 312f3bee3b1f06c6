-- rate_keyed: note a value of a type's keyed limit whose limiter just reserved a slot, so that a
-- change or removal of the limit reaches that value's deferred tasks too.
-- KEYS[1] the values noted (zset: key token -> µs of the server clock until which its limiter may hold slots)
-- ARGV[1] the key token   ARGV[2] µs from now until which its limiter may hold slots
-- ARGV[3] how many values may be noted at once
-- Returns: 1 noted, 0 not (as many values still holding slots are noted already: the tasks of
-- this one wait out their slots after a change). Values whose time has passed are dropped, and the
-- set expires with the last of them.
-- include: args
local now = server_now_us()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local most = int_arg(ARGV[3], 0, 0, 2 ^ 53)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= most then
  return 0
end
redis.call('ZADD', KEYS[1], 'GT', now + int_arg(ARGV[2], 0, 0, 2 ^ 53), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ttl_ms = math.max(1, math.ceil((tonumber(last[2]) - now) / 1000))
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', ttl_ms))
return 1
