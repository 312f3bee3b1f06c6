-- rate_removed: a type's (unkeyed) limit was removed: list every queue holding tasks with slots
-- of its limiter as one whose tasks are due now.
-- KEYS[1] the queues whose delayed sets hold tasks with slots of the limiter (hash: queue -> µs of its latest denial)
-- KEYS[2] the queues whose tasks have yet to follow a changed limit (hash: queue -> mode)
-- Returns: how many queues are left to follow. Calling it again (every consumer notices the
-- removal) lists only the queues not yet done: a queue done is gone from KEYS[1].
-- include: key_types
local refused = wrong_key_type({'hash', 'hash'})
if refused then return refused end
local queues = redis.call('HKEYS', KEYS[1])
for _, queue in ipairs(queues) do
  redis.call('HSET', KEYS[2], queue, 'now')
end
local ttl = redis.call('PTTL', KEYS[1])  -- the list expires with the limiter, even if nobody follows it up
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return redis.call('HLEN', KEYS[2])
