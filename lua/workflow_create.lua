-- workflow_create: store a workflow's whole tree in its own keys and start it: mark started the
-- tasks that begin at once (every member of a group, the first step of a chain).
-- KEYS[1]..KEYS[8] the workflow's keys (see include/workflow.lua)
-- ARGV[1] digest of the tree   ARGV[2] time to live (s) of the keys once the workflow ends
-- ARGV[3] number of tasks, then per node: path, spec ("t", "g <n> <policy>", "c <n> <policy>"),
-- and its envelope template ("" for a group or chain)
-- Returns: {1, "", path, input, ...} created, with the tasks to push now (input "": none);
-- {2, "", path, input, ...} created earlier from the same tree (a retried enqueue), with the tasks it
-- started then; {0} a workflow of this id exists with another tree (nothing written).

-- include: args
-- include: workflow
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'digest') ~= ARGV[1] then return {0} end
  local initial = redis.call('HGET', KEYS[1], 'initial')
  local paths = {}
  for path in string.gmatch(initial, '%S+') do table.insert(paths, path) end
  return wf_reply(2, paths)
end
wf_ttl_s = int_arg(ARGV[2], 604800, 1, 2147483647)
for i = 4, #ARGV, 3 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  if ARGV[i + 2] ~= '' then redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2]) end
end
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'created_ms', server_now_ms(), 'digest', ARGV[1], 'tasks', ARGV[3])
wf_start('0', nil)
redis.call('HSET', KEYS[1], 'initial', table.concat(wf_pushes, ' '))
return wf_reply(1, wf_pushes)
