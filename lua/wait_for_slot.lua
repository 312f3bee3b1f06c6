-- wait_for_slot: queue a task that found no free slot (already deferred into delayed) as a waiter.
-- KEYS[1] slots zset   KEYS[2] waiters zset   KEYS[3] waiting hash (see include/slots.lua)
-- ARGV[1] limit   ARGV[2] waiter id (sha1 of ARGV[3])   ARGV[3] "<queue>\n<delayed member>"
-- ARGV[4] order (the task's enqueue time in ms: the oldest waiter is woken first; 0 or not a
-- number, a task whose producer set none: now; a waiter already queued keeps its place)
-- ARGV[5] reserve ms   ARGV[6] idle ms   ARGV[7] lease ms (see acquire_slot)
-- Returns: the waiters handed a slot that is free now ("<queue>\n<delayed member>"), possibly
-- this one: a slot that freed between the denial and this call is not missed. None while Redis
-- has been up for less than the lease.
-- include: args
-- include: node
-- include: slots
local now_ms = server_now_ms()
local trusted = evict_expired(now_ms, int_arg(ARGV[7], 30000, 1, 86400000))
if not redis.call('ZSCORE', WAITERS, ARGV[2]) then
  -- Not 0: tasks without an enqueue time would all queue ahead of every other, and a steady
  -- flow of them would starve the rest.
  local order = tonumber(ARGV[4])
  if not order or order ~= order or order <= 0 then order = now_ms end
  redis.call('ZADD', WAITERS, order, ARGV[2])
end
redis.call('HSET', WAITING, ARGV[2], ARGV[3])
local woken = {}
if trusted then
  woken = wake_waiters(int_arg(ARGV[1], 1, 1, 1000000000), now_ms, int_arg(ARGV[5], 5000, 1, 86400000))
end
keep(int_arg(ARGV[6], 60000, 1000, 86400000))
return woken
