-- return_unstarted: put claimed tasks that never started back at the head of pending.
-- KEYS[1] processing list of this consumer   KEYS[2] pending list
-- ARGV[1..n] serialized tasks, in the order they should run
-- Returns: how many were returned (tasks no longer in the processing list are skipped).
local returned = 0
for i = #ARGV, 1, -1 do
  if redis.call('LREM', KEYS[1], -1, ARGV[i]) > 0 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    returned = returned + 1
  end
end
return returned
