-- renew_slots: extend the slots a live consumer's runs hold, with its lease (from its heartbeat).
-- KEYS[1] slots zset (see include/slots.lua)
-- ARGV[1] lease ms   ARGV[2] idle ms   ARGV[3..n] holder tokens
-- Returns: how many were renewed. A holder already evicted (its consumer was presumed dead) is
-- not brought back: its slot may be someone else's now. While Redis has been up for less than
-- the lease, a missing holder is put back: Redis lost it, and no slot was given out meanwhile
-- (see include/slots.lua).
-- include: args
-- include: node
local lease_ms = int_arg(ARGV[1], 30000, 1, 86400000)
local deadline = server_now_ms() + lease_ms
local put_back = node_state() < lease_ms
local renewed = 0
for i = 3, #ARGV do
  if put_back then
    renewed = renewed + redis.call('ZADD', KEYS[1], 'CH', deadline, 'h:' .. ARGV[i])
  else
    renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', deadline, 'h:' .. ARGV[i])
  end
end
redis.call('PEXPIRE', KEYS[1], int_arg(ARGV[2], 60000, 1000, 86400000))
return renewed
