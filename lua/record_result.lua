-- record_result: update the result records of one or more tasks of one queue, appending to their
-- JSON lists, fenced by run, move each task between the status indexes of the queue's history and
-- count the writes the records take in the queue's chart counters.
-- ARGV[1] s, the number of status indexes (0: no history index, no chart counters)   ARGV[2] to
-- ARGV[1 + s] the status names of those indexes; if s > 0, ARGV[2 + s] the chart counters' time
-- to live (s), ARGV[3 + s] the cap of the history index and ARGV[4 + s] the age (ms) of its
-- entries at most, to which it is trimmed as tasks enter it (0: not trimmed); then g, the number of processing lists that hold writes of the call (0: none),
-- and per list two arguments: the id of the consumer settling its tasks and its process's
-- instance token ("": unchecked); then one group per record: if g > 0, first j (0: not held,
-- else the list 1..g holding it) and its task as claimed ("" if not held), then its time to live
-- (s), worker id to append or "", error JSON object to append or "", fencing token of the run the
-- update belongs to (issued at claim) or "" (unconditional: not a run's write), the task id, if
-- s > 0 c and c chart counter fields (each incremented by 1 if this write is taken: answered 1),
-- p, then p field/value pairs to set (values are stored as given).
-- KEYS: if s > 0, KEYS[1] history zset, KEYS[2] history ids zset, KEYS[3] to KEYS[2 + s] the
-- status indexes, KEYS[3 + s] this minute's chart counters hash of the queue; then per list that
-- list, its queue's consumer info hash and its queue's consumers zset; then the records' hashes,
-- one per group, in the groups' order.
-- A held write is not written, and answers 3, unless the script settling its task (ack,
-- retry_later or dead_letter), which the caller runs after this call, will find the task (see
-- include/settle.lua): its list holds it and no other instance registered the consumer id. A
-- settling run whose task was reaped leaves the record to the run that holds the task now (one
-- server only: on Redis Cluster the list lies in another slot than the record). While the
-- consumer id is in the consumers zset it was not reaped (reap and a restart's recovery take it
-- out first, and it never comes back under the same instance), so its list still holds every
-- task it claimed and has not settled: the list is searched only once the id is gone. (A claim
-- undone by a Redis machine crash that lost its last second is the exception: see PROTOCOL.md.)
-- The record keeps the highest token that wrote to it in its field "fence". A write with a lower token is ignored (its run lost the claim: its consumer was presumed dead and the task
-- re-run or requeued); a write with a higher token takes the record over.
-- A write with a higher token that sets status RUNNING starts a run: it is refused, and nothing
-- is written, if the task was cancelled (see include/start_gate.lua): the consumer drops the task
-- unrun. A RUNNING write after a claim's receipt (claim_receipts.lua) carries the receipt's
-- token, so it is never refused: the receipt decided.
-- A write that sets status READY (a retry) clears claimed_fence: the task waits again.
-- A write that changes the field "status" moves the id from the index of the old status (a
-- record without one is READY) to that of the new one, keeping its enqueue-time score; one that
-- sets the status the record has files it there and out of every other status's index (a
-- refused receipt's CANCELLED, filed by the consumer's next write).
-- A write with a time to live of 0 ends a task whose type keeps no record of that outcome: once
-- it passes the checks above, it deletes the record and takes the task out of the history index.
-- A write of a run that the record already holds (the same token, the status the record has,
-- and the same time it was attempted, finished or is due again) was sent again after its reply
-- was lost: its fields are set again, but it appends nothing, and it answers 4, so it is not
-- counted again.
-- Returns: per group, 1 written, 0 ignored, 2 refused (the task was cancelled), 3 not held,
-- 4 written again (a re-sent write), or an error (a record a producer wrote as another type): one group's error
-- stops no other group.

-- include: args
-- include: history
-- include: start_gate
-- include: instance
local indexes = int_arg(ARGV[1], 0, 0, math.min(#KEYS - 3, #ARGV - 2))
local h = nil
local counters = nil  -- the chart counters hash, and the increments of its fields
if indexes > 0 then
  h = history_keys(KEYS[1], KEYS[2], {unpack(ARGV, 2, 1 + indexes)}, 3)
  counters = {key = KEYS[3 + indexes], ttl_s = int_arg(ARGV[2 + indexes], 7200, 1, 2 ^ 31), add = {}, names = {}}
  history_trim_on_entry(h, int_arg(ARGV[3 + indexes], 0, 0, 2 ^ 53), int_arg(ARGV[4 + indexes], 0, 0, 2 ^ 53))
end

-- Count the fields ARGV[first .. first + n - 1] once more (their write was taken).
local function tally(first, n)
  for i = first, first + n - 1 do
    local name = ARGV[i]
    if not counters.add[name] then
      counters.add[name] = 0
      counters.names[#counters.names + 1] = name
    end
    counters.add[name] = counters.add[name] + 1
  end
end

-- File the task of record `key` under `status` (from `old`; nil: from every other status);
-- `read` holds the record's fields read with its fence (nil: none were: read them if needed).
local function file_under(key, task_id, old, status, ttl_s, read)
  if h == nil then return end
  if status == old then old = nil end  -- no change: make sure the index agrees (every other index)
  local function enqueued()
    if read then return tonumber(read.enqueued_at_ms) end
    return tonumber(redis.call('HGET', key, 'enqueued_at_ms'))
  end
  history_move(h, task_id, old, status, enqueued, ttl_s * 1000, read ~= nil and read.first)
end

-- The JSON list `text` with `item` appended; a list that is not JSON (a producer's) is started afresh.
local function appended(text, item)
  if not text then return '[' .. cjson.encode(item) .. ']' end  -- the first item (a task's first run)
  local ok, list = pcall(cjson.decode, text)
  if not ok or type(list) ~= 'table' then list = {} end
  list[#list + 1] = item
  return cjson.encode(list)
end

local function append(key, field, item)
  redis.call('HSET', key, field, appended(redis.call('HGET', key, field), item))
end

-- The time fields that tell one write of a run from another of the same status.
local WRITE_TIMES = {last_attempted_at_ms = true, finished_at_ms = true, run_after_ms = true}

-- Whether the record already holds this write of the run: it sets a time field the record has.
local function written_before(key, pairs_to_set)
  for i = 1, #pairs_to_set - 1, 2 do
    if WRITE_TIMES[pairs_to_set[i]] then
      return redis.call('HGET', key, pairs_to_set[i]) == pairs_to_set[i + 1]
    end
  end
  return false
end

-- One group: `u` holds its arguments (ttl_s, worker, error, token, fence_arg, id, pairs).
local function write_record(key, u)
  local new = nil
  local sets = {}  -- what the write sets of the fields read below
  for i = 1, #u.pairs - 1, 2 do
    local name = u.pairs[i]
    if name == 'status' then new = u.pairs[i + 1] end
    if name == 'worker_ids' or name == 'enqueued_at_ms' then sets[name] = u.pairs[i + 1] end
  end
  local old = false
  local again = false
  -- Read with the fence, when it is read: the list the worker id joins, and the enqueue time a
  -- move in the history index may need, each as this write leaves it (false: the record has none).
  local read = nil
  if u.token or new then
    local current = redis.call('HMGET', key, 'fence', 'status', 'cancel_requested_at_ms', 'worker_ids',
                               'enqueued_at_ms')
    read = {worker_ids = sets.worker_ids or current[4], enqueued_at_ms = sets.enqueued_at_ms or current[5],
            first = not current[2]}  -- its first status write: the index most likely lacks the task
    local fence = stored_int(current[1]) or 0
    old = current[2] or 'READY'
    if u.token and u.token < fence then
      return 0
    end
    if u.token and new == 'RUNNING' and u.token > fence and cancelled_before_start(key, old, current[3]) then
      if old ~= 'CANCELLED' then file_under(key, u.id, old, 'CANCELLED', u.ttl_s) end
      return 2
    end
    again = u.token == fence and new == old and written_before(key, u.pairs)
  end
  if u.ttl_s == 0 then  -- its type keeps no record of how it ended: the record and its entries go
    redis.call('DEL', key)
    if h then history_drop(h, {u.id}) end
    return 1
  end
  -- The fields and the fence in one HSET.
  local pairs_to_set = u.pairs
  if u.token then
    pairs_to_set[#pairs_to_set + 1] = 'fence'
    pairs_to_set[#pairs_to_set + 1] = u.fence_arg
  end
  if new == 'READY' then
    pairs_to_set[#pairs_to_set + 1] = 'claimed_fence'
    pairs_to_set[#pairs_to_set + 1] = ''
  end
  local appends_worker = u.worker ~= '' and not again
  if appends_worker and read then  -- the list was read: one HSET sets it with the fields
    pairs_to_set[#pairs_to_set + 1] = 'worker_ids'
    pairs_to_set[#pairs_to_set + 1] = appended(read.worker_ids, u.worker)
    appends_worker = false
  end
  if #pairs_to_set > 0 then
    redis.call('HSET', key, unpack(pairs_to_set))
  end
  if appends_worker then append(key, 'worker_ids', u.worker) end
  if u.error ~= '' and not again then
    local ok, item = pcall(cjson.decode, u.error)
    if ok then append(key, 'errors', item) end
  end
  redis.call('EXPIRE', key, u.ttl_s)
  if new then file_under(key, u.id, old, new, u.ttl_s, read) end
  return again and 4 or 1
end

local replies = {}
local lists_at = indexes > 0 and 5 + indexes or 2
local first_list = indexes > 0 and 4 + indexes or 1
local lists = int_arg(ARGV[lists_at], 0, 0,
  math.min(math.floor((#ARGV - lists_at) / 2), math.floor((#KEYS - first_list + 1) / 3)))
local first_record = first_list + 3 * lists
local at = lists_at + 1 + 2 * lists

-- Per list (read once a call): 'other' (another instance registered its consumer id), 'live'
-- (the id is still a consumer of the queue: never reaped) or 'reaped' (search the list).
local standing = {}
local function standing_of(j)
  local list_keys = first_list + 3 * j - 3
  local id = ARGV[lists_at + 2 * j - 1]
  local ok, other = pcall(other_instance, KEYS[list_keys + 1], id, ARGV[lists_at + 2 * j])
  if not ok or other then return 'other' end
  local live = redis.pcall('ZSCORE', KEYS[list_keys + 2], id)
  return (live and type(live) ~= 'table') and 'live' or 'reaped'
end
-- Whether list `j` holds `task` for its instance.
local function held_by(j, task)
  standing[j] = standing[j] or standing_of(j)
  if standing[j] ~= 'reaped' then return standing[j] == 'live' end
  return type(redis.pcall('LPOS', KEYS[first_list + 3 * j - 3], task or '')) == 'number'
end

for key_index = first_record, #KEYS do
  local holder, task = 0, nil
  if lists > 0 then
    holder, task = int_arg(ARGV[at], 0, 0, lists), ARGV[at + 1]
    at = at + 2
  end
  local counted = 0
  if counters then counted = int_arg(ARGV[at + 5], 0, 0, #ARGV - at - 6) end
  local count_at = at + 5 + (counters and 1 + counted or 0)  -- where p is
  if count_at > #ARGV then break end
  local count = int_arg(ARGV[count_at], 0, 0, math.floor((#ARGV - count_at) / 2))
  local first = at
  local function this_group()  -- inside the pcall: even a group too large to unpack fails alone
    local u = {
      ttl_s = tonumber(ARGV[first]) or 604800, worker = ARGV[first + 1], error = ARGV[first + 2],
      token = tonumber(ARGV[first + 3]), fence_arg = ARGV[first + 3], id = ARGV[first + 4],
      pairs = count > 0 and {unpack(ARGV, count_at + 1, count_at + 2 * count)} or {},
    }
    return write_record(KEYS[key_index], u)
  end
  at = count_at + 1 + 2 * count
  if holder > 0 and not held_by(holder, task) then
    replies[#replies + 1] = 3
  else
    local ok, reply = pcall(this_group)
    if ok then
      replies[#replies + 1] = reply
      if reply == 1 and counted > 0 then tally(first + 6, counted) end
    else
      replies[#replies + 1] = {err = type(reply) == 'table' and reply.err or tostring(reply)}
    end
  end
end
if h then history_trim_entered(h) end
-- One increment per field.
if counters and #counters.names > 0 then
  for _, name in ipairs(counters.names) do redis.pcall('HINCRBY', counters.key, name, counters.add[name]) end
  redis.pcall('EXPIRE', counters.key, counters.ttl_s)
end
return replies
