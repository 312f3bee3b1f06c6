-- claim: move up to N tasks into this consumer's processing list, highest priority first.
-- KEYS[1] pending list   KEYS[2] prioritized zset   KEYS[3] processing list of this consumer
-- KEYS[4] consumers zset (lease deadlines)   KEYS[5] suspects list (tasks recovered from dead
-- consumers, waiting to run where a death can be pinned on them)   KEYS[6] fence counter
-- KEYS[7] (optional) paused marker of the queue: while it exists nothing is claimed
-- ARGV[1] consumer id    ARGV[2] N (max tasks)     ARGV[3] wake token (dropped, never returned)
-- ARGV[4] "1" to first remove one wake token that a blocking claim put in processing
-- ARGV[5] "1" if this consumer may take a suspect (it holds none)
-- Returns: false if this consumer holds no lease (it was reaped); {-1, 0, 0} if its lease lapsed
-- (not renewed in time: it claims nothing until a renewal succeeds); {-2, 0, 0} if the queue is
-- paused (nothing claimed, suspects included); else {s, w, f, tasks...}:
-- s = 1 when the first task is a suspect (at most one), w = suspects still waiting, f = the
-- fencing token of the first task (task i holds f + i - 1; 0 if none was claimed; issued as in
-- issue_fence.lua). Order: the suspect, priority > 0, the pending list (priority 0),
-- priority < 0; oldest first within each. Tasks are popped before they are pushed: the processing
-- list's type is checked first, so a key of the wrong type stops the script before a task moved.
local deadline = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not deadline then
  return false
end
-- include: args
if tonumber(deadline) <= server_now_ms() then
  return {-1, 0, 0}
end
if KEYS[7] and redis.call('EXISTS', KEYS[7]) == 1 then
  return {-2, 0, 0}
end
redis.call('LLEN', KEYS[3])  -- its type, checked before the first pop
if ARGV[4] == '1' then
  redis.call('LREM', KEYS[3], 1, ARGV[3])
end
local want = tonumber(ARGV[2])
-- include: priority
local zero = priority_score(0, 0)  -- score of the first priority-0 slot
local claimed = {}
local suspect = false
if ARGV[5] == '1' and want > 0 then
  suspect = redis.call('RPOPLPUSH', KEYS[5], KEYS[3])
  if suspect then claimed[1] = suspect end
end

-- `command` on `key` with every item of `items`, in order; unpack is limited to a few thousand
-- values, so in chunks.
local function on_all(command, key, items)
  for from = 1, #items, 1000 do
    redis.call(command, key, unpack(items, from, math.min(#items, from + 999)))
  end
end

-- Push tasks just popped onto the processing list, one call for many (each on the head in turn,
-- as with an LPUSH a task), and count them claimed.
local function hold(items)
  on_all('LPUSH', KEYS[3], items)
  for _, item in ipairs(items) do claimed[#claimed + 1] = item end
end

local function take_prioritized(min, max)
  if want - #claimed <= 0 then return end
  local items = redis.call('ZRANGE', KEYS[2], min, max, 'BYSCORE', 'LIMIT', 0, want - #claimed)
  on_all('ZREM', KEYS[2], items)
  hold(items)
end

-- A read, so tracking tells of the next add; an empty set is not searched.
local prioritized = redis.call('ZCARD', KEYS[2]) > 0
if prioritized then take_prioritized('-inf', '(' .. zero) end
while want - #claimed > 0 do
  local items = redis.call('RPOP', KEYS[1], want - #claimed)
  if not items then break end
  local tasks = {}
  for _, item in ipairs(items) do
    if item ~= ARGV[3] then tasks[#tasks + 1] = item end
  end
  hold(tasks)
end
if prioritized then take_prioritized('(' .. zero, '+inf') end
-- include: fence
local first_fence = 0
if #claimed > 0 then
  first_fence = issue_fences(KEYS[6], #claimed)
end
-- Read last, after this script's own pops (a write ends a key's tracking): a consumer claiming on a
-- tracked connection is told when another client pushes here (tracking.py). With nothing claimed, the
-- reads above came after every write.
if #claimed > 0 then
  redis.call('LLEN', KEYS[1])
  redis.call('ZCARD', KEYS[2])
end
table.insert(claimed, 1, first_fence)
table.insert(claimed, 1, redis.call('LLEN', KEYS[5]))
table.insert(claimed, 1, suspect and 1 or 0)
return claimed
