-- release_slot: give back a run's slot and hand each free slot to the oldest waiter.
-- KEYS[1] slots zset   KEYS[2] waiters zset   KEYS[3] waiting hash (see include/slots.lua)
-- ARGV[1] holder token   ARGV[2] limit   ARGV[3] reserve ms   ARGV[4] idle ms   ARGV[5] lease ms
-- (see acquire_slot)
-- Returns: the waiters woken ("<queue>\n<delayed member>"), one per free slot: the caller moves
-- each one's task from delayed to pending. None while Redis has been up for less than the lease.
-- include: args
-- include: node
-- include: slots
local now_ms = server_now_ms()
redis.call('ZREM', SLOTS, 'h:' .. ARGV[1])
local woken = {}
if evict_expired(now_ms, int_arg(ARGV[5], 30000, 1, 86400000)) then
  woken = wake_waiters(int_arg(ARGV[2], 1, 1, 1000000000), now_ms, int_arg(ARGV[3], 5000, 1, 86400000))
end
keep(int_arg(ARGV[4], 60000, 1000, 86400000))
return woken
