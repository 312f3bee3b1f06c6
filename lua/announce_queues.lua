-- announce_queues: add queue names to the queue set, what the dashboard finds queues by.
-- KEYS[1] the queue set
-- ARGV[1..] queue names
-- Returns: how many names were new.
local added = 0
-- unpack is limited to a few thousand values: add in chunks.
for from = 1, #ARGV, 1000 do
  added = added + redis.call('SADD', KEYS[1], unpack(ARGV, from, math.min(#ARGV, from + 999)))
end
return added
