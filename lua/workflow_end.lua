-- workflow_end: record the end of a workflow's task once, move the workflow on, and return the
-- tasks that end started; a repeated end (a re-run, a duplicate delivery, a settle retried after
-- a kill) records nothing and returns the same tasks again.
-- KEYS[1]..KEYS[8] the workflow's keys (see include/workflow.lua)
-- KEYS[9] (optional, one server) the settling consumer's processing list   KEYS[10] its queue's
-- consumer info hash
-- ARGV[1] the task's path   ARGV[2] its outcome: SUCCESSFUL, FAILED (for good) or CANCELLED
-- ARGV[3] its value: the return value's JSON, or an error entry's   ARGV[4] bytes an input may
-- hold   ARGV[5] time to live (s) of the keys once the workflow ends   ARGV[6] (with KEYS[9]) the
-- task as claimed   ARGV[7] consumer id   ARGV[8] the settling process's instance token
-- Returns: {1, ended, path, input, ...} recorded, with the tasks to push now (input "": none) and
-- the status this end ended the workflow with (ended "": it did not end it);
-- {2, "", path, input, ...} recorded before, with the tasks that end started and whose own end is
-- not recorded yet; {0} no such workflow (expired), or no task at that path (a foreign header);
-- {-1} the run no longer owns its task (not in the list, or another instance registered the
-- consumer id): nothing written.
-- A task that failed under "stop" is kept in the failed hash and ends the workflow FAILED; its
-- later success (requeued from the dead letters, retried) is recorded and the workflow goes on.
-- A workflow CANCELLED records ends and starts nothing.

-- include: args
-- include: instance
-- include: workflow
if redis.call('HGET', KEYS[2], ARGV[1]) ~= 't' then return {0} end
if KEYS[9] and (other_instance(KEYS[10], ARGV[7], ARGV[8]) or not redis.call('LPOS', KEYS[9], ARGV[6])) then
  return {-1}
end
local path, outcome, value = ARGV[1], ARGV[2], ARGV[3]
local fired = redis.call('HGET', KEYS[8], path)
if fired then  -- a task started then that has ended since was pushed: its id may have left `enqueued`
  local paths = {}
  for started in string.gmatch(fired, '%S+') do
    if redis.call('HEXISTS', KEYS[6], started) == 0 then table.insert(paths, started) end
  end
  return wf_reply(2, paths)
end
if redis.call('HEXISTS', KEYS[6], path) == 1 then return {2} end
wf_max_input = int_arg(ARGV[4], 1048576, 0, 2147483647)
wf_ttl_s = int_arg(ARGV[5], 604800, 1, 2147483647)
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'CANCELLED' then
  redis.call('HSET', KEYS[6], path, outcome)
  redis.call('HSETNX', KEYS[5], path, value)
  redis.call('HDEL', KEYS[7], path)
  return {1}
end
if outcome == 'SUCCESSFUL' then
  redis.call('HSET', KEYS[6], path, outcome)
  if redis.call('HDEL', KEYS[7], path) == 1 and status == 'FAILED' then
    local still = redis.call('HKEYS', KEYS[7])
    if #still > 0 then
      redis.call('HSET', KEYS[1], 'failed_path', still[1], 'error', redis.call('HGET', KEYS[7], still[1]))
    elseif not redis.call('HGET', KEYS[1], 'stopped') then  -- it failed only for this task: it goes on
      redis.call('HSET', KEYS[1], 'status', 'RUNNING')
      redis.call('HDEL', KEYS[1], 'failed_path', 'error', 'ended_ms')
      wf_keys_expire(nil)
    end
  end
  wf_ended(path, value)
else
  if redis.call('HEXISTS', KEYS[7], path) == 1 then return {2} end
  if not wf_failed(path, value) then return {1, wf_now_ended} end
  redis.call('HSET', KEYS[6], path, outcome)
end
redis.call('HSET', KEYS[8], path, table.concat(wf_pushes, ' '))
return wf_reply(1, wf_pushes)
