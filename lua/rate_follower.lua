-- rate_follower: take, keep or give back the lease of the one consumer bringing a limiter's
-- deferred tasks to a changed limit (the others wait, and take over if it dies).
-- KEYS[1] the lease (string: the holder's token, expiring)
-- ARGV[1] the caller's token   ARGV[2] ms to hold it for; 0 gives it back
-- Returns: 1 the caller holds it (for ARGV[2] ms from now), 0 another does (or, with 0 ms, it was
-- not the caller's).
-- include: args
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
local ms = int_arg(ARGV[2], 0, 0, 2 ^ 53)
if ms == 0 then
  return redis.call('DEL', KEYS[1])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ms)
return 1
