-- record_result: update a task's result record, appending to its JSON lists, fenced by run,
-- and move the task between the status indexes of its queue's history.
-- KEYS[1] result hash; if ARGV[5] > 0, KEYS[2] history zset, KEYS[3] history ids zset, then
-- KEYS[4] to KEYS[3 + ARGV[5]] the status indexes of the statuses named in ARGV[7...].
-- ARGV[1] time to live (s)   ARGV[2] worker id to append, or ""   ARGV[3] error JSON object to
-- append, or ""   ARGV[4] fencing token of the run this update belongs to (issued at claim),
-- or "" (unconditional: not a run's write)   ARGV[5] s, the number of status indexes (0: no
-- history index, a single key)   ARGV[6] the task id   ARGV[7] to ARGV[6 + s] the status names
-- of those indexes; then field/value pairs to set (values are stored as given).
-- The record keeps the highest token that wrote to it in its field "fence". A write with a
-- lower token is ignored (its run lost the claim: its consumer was presumed dead and the task
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
-- Returns: 1 written, 0 ignored, 2 refused: the task was cancelled.

-- include: args
-- include: history
-- include: start_gate
local token = tonumber(ARGV[4])
local indexes = int_arg(ARGV[5], 0, 0, #KEYS - 3)
local first = 7 + indexes
local last = #ARGV - ((#ARGV - first + 1) % 2)
local new = nil
for i = first, last - 1, 2 do
  if ARGV[i] == 'status' then new = ARGV[i + 1] end
end
local ttl_s = tonumber(ARGV[1]) or 604800
local function file_under(old, status)
  if indexes == 0 then return end
  if status == old then old = nil end  -- no change: make sure the index agrees (every other index)
  local h = history_keys(KEYS[2], KEYS[3], {unpack(ARGV, 7, 6 + indexes)}, 4)
  local function enqueued_ms()
    return tonumber(redis.call('HGET', KEYS[1], 'enqueued_at_ms')) or server_now_ms()
  end
  history_move(h, ARGV[6], old, status, enqueued_ms, ttl_s * 1000)
end
local old = false
if token or new then
  local current = redis.call('HMGET', KEYS[1], 'fence', 'status', 'cancel_requested_at_ms')
  local fence = tonumber(current[1]) or 0
  old = current[2] or 'READY'
  if token and token < fence then
    return 0
  end
  if token and new == 'RUNNING' and token > fence and cancelled_before_start(KEYS[1], old, current[3]) then
    if old ~= 'CANCELLED' then file_under(old, 'CANCELLED') end
    return 2
  end
end
-- The fields and the fence in one HSET.
local pairs_to_set = {unpack(ARGV, first, last)}
if token then
  pairs_to_set[#pairs_to_set + 1] = 'fence'
  pairs_to_set[#pairs_to_set + 1] = ARGV[4]
end
if new == 'READY' then
  pairs_to_set[#pairs_to_set + 1] = 'claimed_fence'
  pairs_to_set[#pairs_to_set + 1] = ''
end
if #pairs_to_set > 0 then
  redis.call('HSET', KEYS[1], unpack(pairs_to_set))
end
-- A list field a foreign writer left malformed is started afresh rather than failing the write.
local function append(field, item)
  local ok, list = pcall(cjson.decode, redis.call('HGET', KEYS[1], field) or '[]')
  if not ok or type(list) ~= 'table' then list = {} end
  list[#list + 1] = item
  redis.call('HSET', KEYS[1], field, cjson.encode(list))
end
if ARGV[2] ~= '' then append('worker_ids', ARGV[2]) end
if ARGV[3] ~= '' then
  local ok, item = pcall(cjson.decode, ARGV[3])
  if ok then append('errors', item) end
end
redis.call('EXPIRE', KEYS[1], ttl_s)
if new then file_under(old, new) end
return 1
