-- workflow_stop: end a workflow that has not ended: CANCELLED by a person, or FAILED because a
-- step cannot be pushed (its arguments over the payload limit, its unique key held by another task).
-- KEYS[1]..KEYS[8] the workflow's keys (see include/workflow.lua)
-- ARGV[1] CANCELLED or FAILED   ARGV[2] the reason   ARGV[3] time to live (s) of the keys once it
-- ended   ARGV[4] (FAILED) the path of the step that cannot be pushed
-- Returns: {1, path, ...} stopped, with the tasks started whose end is not recorded (a cancel asks
-- each of them to stop); {2, status} it had ended already (SUCCESSFUL, or CANCELLED; a FAILED one
-- can still be cancelled, not failed again); {0} no such workflow.

-- include: args
-- include: workflow
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'SUCCESSFUL' or status == 'CANCELLED' or (ARGV[1] == 'FAILED' and status == 'FAILED') then
  return {2, status}
end
wf_ttl_s = int_arg(ARGV[3], 604800, 1, 2147483647)
if ARGV[1] == 'CANCELLED' then
  redis.call('HSET', KEYS[1], 'cancelled_by', ARGV[2])
else
  redis.call('HSET', KEYS[1], 'failed_path', ARGV[4], 'error', ARGV[2], 'stopped', '1')
end
wf_end_workflow(ARGV[1], server_now_ms())
local reply = {1}
local started = redis.call('HKEYS', KEYS[4])
for first = 1, #started, 1000 do
  local fields = {unpack(started, first, math.min(#started, first + 999))}
  local ended = redis.call('HMGET', KEYS[6], unpack(fields))
  for i, path in ipairs(fields) do
    if not ended[i] then table.insert(reply, path) end
  end
end
return reply
