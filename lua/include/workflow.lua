-- A workflow's tree and its progress, shared by workflow_create, workflow_end and workflow_stop.
-- The workflow's keys, all under its own hash tag, come first in KEYS:
-- KEYS[1] meta hash (status, created_ms, ended_ms, digest, tasks, initial, failed_path, error,
--   stopped, and "n:<path>": members ended of each group)
-- KEYS[2] nodes hash: path -> "t" (a task), "g <n> <policy>" (group), "c <n> <policy>" (chain)
-- KEYS[3] steps hash: path -> a task's envelope template (JSON, read by the producer only)
-- KEYS[4] starts hash: task path -> "" (started without input) or "=" .. input JSON
-- KEYS[5] results hash: path -> JSON value of an ended node (a return value, a list, an error entry)
-- KEYS[6] outcomes hash: task path -> SUCCESSFUL, FAILED or CANCELLED, once its end is recorded
-- KEYS[7] failed hash: task path -> error entry of a member that failed under "stop", not yet ended
-- KEYS[8] fired hash: task path -> the task paths its recorded end started, space-separated
-- Paths name nodes: the root is "0", the third child of node "0.1" is "0.1.2".

local wf_pushes = {}  -- task paths started by this call, in order
local wf_max_input = 0  -- bytes an input may hold (TASKS_MAX_PAYLOAD_BYTES), set by the script
local wf_ttl_s = 0  -- the keys' time to live once the workflow ended, set by the script
local wf_now_ended = ''  -- the status this call ended the workflow with ('': it did not end it)

local function wf_parent(path)
  return string.match(path, '^(.*)%.%d+$')
end

local function wf_node(path)
  local spec = redis.call('HGET', KEYS[2], path)
  local kind, n, policy = string.match(spec, '^(%a) ?(%d*) ?(%a*)$')
  return kind, tonumber(n), policy
end

local function wf_keys_expire(ttl_s)
  for i = 1, 8 do
    if ttl_s then redis.call('EXPIRE', KEYS[i], ttl_s) else redis.call('PERSIST', KEYS[i]) end
  end
end

local function wf_end_workflow(status, now_ms)
  redis.call('HSET', KEYS[1], 'status', status, 'ended_ms', now_ms)
  wf_now_ended = status
  wf_keys_expire(wf_ttl_s)
end

-- Start node `path` with `input` (JSON text, or nil for none): a task is marked started and pushed,
-- a group starts every member, a chain its first step.
local function wf_start(path, input)
  local kind, n = wf_node(path)
  if kind == 't' then
    if redis.call('HSETNX', KEYS[4], path, input and ('=' .. input) or '') == 1 then
      table.insert(wf_pushes, path)
    end
  elseif kind == 'g' then
    for i = 0, n - 1 do wf_start(path .. '.' .. i, input) end
  else
    wf_start(path .. '.0', input)
  end
end

-- Start `path` with an input produced by the workflow, unless it is too large for a payload: then
-- the workflow fails, naming the step.
local function wf_begin(path, input)
  if #input > wf_max_input then
    redis.call('HSET', KEYS[1], 'failed_path', path, 'stopped', '1', 'error',
      'the input of step ' .. path .. ' is ' .. #input .. ' bytes, over TASKS_MAX_PAYLOAD_BYTES (' ..
      wf_max_input .. ')')
    wf_end_workflow('FAILED', server_now_ms())
    return
  end
  wf_start(path, input)
end

-- The JSON list of the results of group `path`'s n members, in member order.
local function wf_group_value(path, n)
  local values = {}
  for first = 0, n - 1, 1000 do
    local fields = {}
    for i = first, math.min(n, first + 1000) - 1 do table.insert(fields, path .. '.' .. i) end
    for _, value in ipairs(redis.call('HMGET', KEYS[5], unpack(fields))) do table.insert(values, value) end
  end
  return '[' .. table.concat(values, ',') .. ']'
end

-- Node `path` ended with `value`: record it once, then move its parent on (the next step of a
-- chain, the end of a group whose members all ended, the end of the workflow).
local function wf_ended(path, value)
  if redis.call('HSETNX', KEYS[5], path, value) == 0 then return end
  local parent = wf_parent(path)
  if not parent then
    if redis.call('HGET', KEYS[1], 'status') == 'RUNNING' then wf_end_workflow('SUCCESSFUL', server_now_ms()) end
    return
  end
  local kind, n = wf_node(parent)
  if kind == 'g' then
    if redis.call('HINCRBY', KEYS[1], 'n:' .. parent, 1) == n then wf_ended(parent, wf_group_value(parent, n)) end
  else
    local next_step = tonumber(string.match(path, '(%d+)$')) + 1
    if next_step < n then wf_begin(parent .. '.' .. next_step, value) else wf_ended(parent, value) end
  end
end

-- Task `path` failed for good (or was cancelled) with error entry `entry`: the nearest ancestor
-- whose policy is "continue" takes the failed branch as ended with `entry`; with none, the
-- workflow fails naming the task. Returns true if an ancestor took it.
local function wf_failed(path, entry)
  local node = path
  while true do
    local parent = wf_parent(node)
    if not parent then
      redis.call('HSET', KEYS[7], path, entry)
      if redis.call('HGET', KEYS[1], 'status') == 'RUNNING' then
        redis.call('HSET', KEYS[1], 'failed_path', path, 'error', entry)
        wf_end_workflow('FAILED', server_now_ms())
      end
      return false
    end
    local _, _, policy = wf_node(parent)
    if policy == 'continue' then
      wf_ended(node, entry)
      return true
    end
    node = parent
  end
end

-- The reply of a script that started tasks: {code, ended, path, input, path, input, ...}, `ended`
-- the status this call ended the workflow with ('' if it did not).
local function wf_reply(code, paths)
  local reply = {code, wf_now_ended}
  for first = 1, #paths, 1000 do
    local fields = {unpack(paths, first, math.min(#paths, first + 999))}
    local inputs = redis.call('HMGET', KEYS[4], unpack(fields))
    for i, path in ipairs(fields) do
      table.insert(reply, path)
      table.insert(reply, inputs[i] or '')
    end
  end
  return reply
end
