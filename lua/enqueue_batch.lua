-- enqueue_batch: push a batch of tasks and write the READY records of those that keep one, all
-- or nothing.
-- KEYS[1] to KEYS[4] for the first queue section, 4 more for each further one: pending list,
-- prioritized zset, delayed zset, enqueued ids zset (task id -> server ms, for ids given by the
-- caller); then, if ARGV[4] is "1", the queue set; then the result hashes of the READY records.
-- ARGV[1] wake token   ARGV[2] how long enqueued ids are remembered (ms)   ARGV[3] at most how
-- many are remembered per queue   ARGV[4] "1" to add the queue names to the queue set
-- ARGV[5] q, the number of queue sections; then each section: queue name, n, n tasks with
-- priority 0, due now and no id to check; m, then m groups of 4: id to check ("" none), priority
-- (-100..100), delay ms (0 = due now), task; h, then h ids of tasks with a record. Then the
-- records: groups of (number of keys, time to live s, p, then p field/value pairs) until the end,
-- their keys in the order of the sections' record ids (the record of the j-th id of them all is
-- the j-th key). Waiting marks are not written here: the caller sends them beside this call.
-- Returns: {tasks pushed, records written, then the position of each task not pushed, counted
-- from 1 over the id-checked groups of all sections; for a call of records alone, the number of
-- each record key left alone because its record names another queue than the one its fields name}. A task whose id was enqueued to its queue
-- before, or earlier in this call (to a task of any section), or whose record (the key of its id
-- among the record ids) names another queue, is not pushed, and neither is its record written:
-- one id given to several tasks of a call keeps the first one's (a record beyond the record ids
-- is written whatever was pushed). A call without queue sections (Redis Cluster,
-- where a record lies in another slot than its queue and is written beside or before its push)
-- writes a record only where no run or cancel touched it (no `fence`, status READY or none), so a
-- retried request whose task was pushed before never rewrites its record, and never over a
-- record naming another queue (the id is another task's: the caller pushes nothing for it).
-- Atomic: the only write that can fail is the first (Redis out of memory, so nothing is written)
-- and nothing after it raises: key types are checked first, records are written with pcall.
-- Keys of different slots (queues, result hashes) are passed on a single Redis server only;
-- on Redis Cluster each call holds one queue section or one record.

-- include: args
-- include: priority
-- include: task_ids
local now_ms = server_now_ms()
local keep_ms = int_arg(ARGV[2], 86400000, 0, 2 ^ 53)
local keep_max = int_arg(ARGV[3], 100000, 1, 2 ^ 53)
local stride = 4
local sections = int_arg(ARGV[5], 0, 0, #KEYS / stride)
-- The queue keys' types, checked before the first push (all or nothing).
for s = 1, sections do
  local base = stride * (s - 1)
  redis.call('LLEN', KEYS[base + 1])
  for k = 2, 4 do redis.call('ZCARD', KEYS[base + k]) end
end

local not_pushed = {}  -- positions, over the call's id-checked groups, of the tasks not pushed
local pushes = {}  -- id checked -> how many of its tasks the call pushed and did not file yet
local section_of = {}  -- id checked -> the section of its first task in the call
local filed = {}  -- per record id of the call, in order: whether its record is written
local first_record = stride * sections + (ARGV[4] == '1' and 2 or 1)
local queue_set = ARGV[4] == '1' and KEYS[stride * sections + 1]
if queue_set then redis.call('SCARD', queue_set) end  -- its type, checked before the first push
local recorded = 0  -- record ids (so record keys) of the sections before this one

-- Whether the next task of `id` listed with a record is filed: one whose id was not checked
-- always; else one of those the call pushed (the first tasks of the id, in order).
local function file_next(id)
  local left = pushes[id]
  if left == nil then return true end
  if left == 0 then return false end
  pushes[id] = left - 1
  return true
end

-- Note which of the h record ids from ARGV[from...] have their record written.
local function file_records(from, h_count)
  for i = from, from + h_count - 1 do filed[#filed + 1] = file_next(ARGV[i]) end
end

local pushed = 0
local function push_plain(pending, first, last)
  -- unpack is limited to a few thousand values: push in chunks.
  for from = first, last, 1000 do
    pushed = pushed + math.min(1000, last - from + 1)
    redis.call('LPUSH', pending, unpack(ARGV, from, math.min(last, from + 999)))
  end
end

-- The record key of each id checked among m groups from ARGV[from...], from the section's h
-- record ids at ARGV[h_at + 1...] (the j-th record id of the call has the j-th record key).
local function records_of(from, m, h_at, h_count)
  local keys = {}
  for g = 1, m do
    if ARGV[from + 4 * g - 4] ~= '' then keys[ARGV[from + 4 * g - 4]] = false end
  end
  if next(keys) == nil then return keys end
  for i = 1, h_count do
    local id = ARGV[h_at + i]
    if keys[id] == false then keys[id] = KEYS[first_record + recorded + i - 1] or false end
  end
  return keys
end

-- Whether id (chosen by the caller) is taken for a task of section s (queue `name`): given to a
-- task of another section before, enqueued to this queue lately, or its record names another queue.
local function seen_before(s, name, id, record_key)
  if id == '' then return false end
  pushes[id] = pushes[id] or 0
  section_of[id] = section_of[id] or s
  local ids_key = KEYS[stride * (s - 1) + 4]
  if section_of[id] ~= s or redis.call('ZSCORE', ids_key, id) or names_another_queue(record_key, name) then
    return true
  end
  redis.call('ZADD', ids_key, now_ms, id)
  pushes[id] = pushes[id] + 1
  return false
end

-- Push one task of section s; returns whether it was pushed and whether it went to prioritized.
local function push_other(s, name, record_key, id, priority, delay_ms, task)
  if seen_before(s, name, id, record_key) then return false, false end
  if delay_ms > 0 then
    redis.call('ZADD', KEYS[stride * (s - 1) + 3], now_ms + delay_ms, string.format('%+04d', priority) .. task)
  elseif priority ~= 0 then
    redis.call('ZADD', KEYS[stride * (s - 1) + 2], priority_score(priority, now_ms), task)
    return true, true
  else
    redis.call('LPUSH', KEYS[stride * (s - 1) + 1], task)
  end
  return true, false
end

local at = 6
local checked = 0  -- id-checked groups of the sections before this one
for s = 1, sections do
  local name, plain = ARGV[at], int_arg(ARGV[at + 1], 0, 0, #ARGV - at - 1)
  push_plain(KEYS[stride * (s - 1) + 1], at + 2, at + 1 + plain)
  at = at + 2 + plain
  local others = int_arg(ARGV[at], 0, 0, math.floor((#ARGV - at) / 4))
  local h_at = at + 1 + 4 * others
  local h_count = int_arg(ARGV[h_at], 0, 0, #ARGV - h_at)
  local record_of = records_of(at + 1, others, h_at, h_count)
  local woke = false
  for g = 1, others do
    local i = at + 4 * g - 3
    local added, prioritized = push_other(s, name, record_of[ARGV[i]], ARGV[i], int_arg(ARGV[i + 1], 0, -100, 100),
                                          int_arg(ARGV[i + 2], 0, 0, 2 ^ 53), ARGV[i + 3])
    if added then pushed = pushed + 1 else not_pushed[#not_pushed + 1] = checked + g end
    woke = woke or prioritized
  end
  checked = checked + others
  file_records(h_at + 1, h_count)
  recorded = recorded + h_count
  at = h_at + 1 + h_count
  if woke and redis.call('LLEN', KEYS[stride * (s - 1) + 1]) == 0 then
    redis.call('LPUSH', KEYS[stride * (s - 1) + 1], ARGV[1])
  end
  if others > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[stride * (s - 1) + 4], '-inf', '(' .. (now_ms - keep_ms))
    local excess = redis.call('ZCARD', KEYS[stride * (s - 1) + 4]) - keep_max
    if excess > 0 then redis.call('ZREMRANGEBYRANK', KEYS[stride * (s - 1) + 4], 0, excess - 1) end
  end
  if queue_set and name then
    redis.call('SADD', queue_set, name)
  end
end

-- Whether a run or a cancel has written to record `key` (a key a producer wrote as another type
-- counts as untouched: its write fails anyway).
local function touched(key)
  local found = redis.pcall('HMGET', key, 'fence', 'status')
  if type(found) ~= 'table' or found.err then return false end
  return (found[1] or '') ~= '' or (found[2] or 'READY') ~= 'READY'
end

-- READY records: a record a producer wrote as another type only loses it, the tasks stay pushed;
-- out of memory before anything was written (a call with records only) is the caller's error.
local written = 0
local taken = {}  -- a call of records alone: the records left alone as they name another queue
local key = first_record
while at + 2 <= #ARGV and key <= #KEYS do
  local count = int_arg(ARGV[at], 0, 0, #KEYS - key + 1)
  local ttl_s = int_arg(ARGV[at + 1], 1, 1, 2 ^ 53)
  local last = at + 2 + 2 * int_arg(ARGV[at + 2], 0, 0, math.floor((#ARGV - at - 2) / 2))
  local queue = sections == 0 and pair_value(at + 3, last, 'queue')
  for i = key, key + count - 1 do
    if names_another_queue(KEYS[i], queue) then
      taken[#taken + 1] = i - first_record + 1
    elseif last > at + 2 and filed[i - first_record + 1] ~= false and not (sections == 0 and touched(KEYS[i])) then
      local outcome = redis.pcall('HSET', KEYS[i], unpack(ARGV, at + 3, last))
      if type(outcome) == 'table' and outcome.err then
        if pushed + written == 0 and string.find(outcome.err, 'OOM', 1, true) then return outcome end
      else
        written = written + 1
        redis.pcall('EXPIRE', KEYS[i], ttl_s)
      end
    end
  end
  key, at = key + count, last + 1
end
local reply = {pushed, written}
for _, position in ipairs(sections > 0 and not_pushed or taken) do reply[#reply + 1] = position end
return reply
