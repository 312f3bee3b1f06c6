-- acquire_slot: take one of a capped type's (or key value's) slots for a task about to run.
-- KEYS[1] slots zset   KEYS[2] waiters zset   KEYS[3] waiting hash (see include/slots.lua)
-- ARGV[1] limit (max running)   ARGV[2] holder token of this run (unique)   ARGV[3] waiter id of
-- the task (sha1 of "<queue>\n<delayed member>")   ARGV[4] lease ms: the holder counts until then
-- unless renewed (renew_slots)   ARGV[5] how long a woken waiter's slot is kept for it (ms)
-- ARGV[6] how long idle keys are kept (ms)
-- Returns: {1, woken...} when the slot was taken, {0} when none is free. A task that was woken
-- takes the slot reserved for it; an expired holder (its consumer died) no longer counts. A
-- holder token that already holds a slot gets it again ({1, ...}): calling twice takes one slot.
-- Redis up for less than the lease: no new slot is given out (see evict_expired).
-- woken: "<queue>\n<delayed member>" of waiters handed a slot left free (a raised limit).
-- include: args
-- include: node
-- include: slots
local now_ms = server_now_ms()
local limit = int_arg(ARGV[1], 1, 1, 1000000000)
local lease_ms = int_arg(ARGV[4], 30000, 1, 86400000)
local reserve_ms = int_arg(ARGV[5], 5000, 1, 86400000)
local trusted = evict_expired(now_ms, lease_ms)
redis.call('ZREM', SLOTS, 'w:' .. ARGV[3])
-- A holder already there is this run's: the retry of a call whose reply was lost takes it again.
local held = redis.call('ZSCORE', SLOTS, 'h:' .. ARGV[2])
if not held and (not trusted or redis.call('ZCARD', SLOTS) >= limit) then
  keep(int_arg(ARGV[6], 60000, 1000, 86400000))
  return {0}
end
redis.call('ZREM', WAITERS, ARGV[3])
redis.call('HDEL', WAITING, ARGV[3])
redis.call('ZADD', SLOTS, now_ms + lease_ms, 'h:' .. ARGV[2])
local out = trusted and wake_waiters(limit, now_ms, reserve_ms) or {}
keep(int_arg(ARGV[6], 60000, 1000, 86400000))
table.insert(out, 1, 1)
return out
