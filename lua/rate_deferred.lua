-- rate_deferred: a task a limiter denied has landed in its queue's delayed set: keep that queue
-- followed, and answer when the task is due as the limiter holds it now.
-- KEYS[1] the limiter's rate hash (its reservations `r:<task id>`)
-- KEYS[2] the queues whose delayed sets hold tasks with slots of the limiter (hash: queue -> µs of its latest denial)
-- ARGV[1] the task id   ARGV[2] the queue its deferral landed in
-- Returns: {due, now} in µs of the server clock: due is the task's reserved slot (moved since the
-- denial if the limit changed), or now if the limiter holds it no more (a removal followed up on
-- every queue dropped it, or every slot passed).
-- A follow-up whose scan began between the denial and this landing may have missed the task: the
-- queue is stamped again as at a denial, so that the follow-up keeps it in KEYS[2] and the next
-- notice of a removal lists it again; a follow-up that took it off before this call has dropped
-- the reservation, or still holds other queues (and the same next notice lists this one).
-- include: args
local now = server_now_us()
local slot = tonumber(redis.call('HGET', KEYS[1], 'r:' .. ARGV[1]))
if not slot or slot <= now then return {now, now} end  -- gone or passed
redis.call('HSET', KEYS[2], ARGV[2], string.format('%.0f', now))
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return {slot, now}
