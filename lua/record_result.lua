-- record_result: update a task's result record, appending to its JSON lists, fenced by run.
-- KEYS[1] result hash
-- ARGV[1] time to live (s)   ARGV[2] worker id to append, or ""   ARGV[3] error JSON object to
-- append, or ""   ARGV[4] fencing token of the run this update belongs to (issued at claim),
-- or "" (unconditional: not a run's write); then field/value pairs to set (values are stored
-- as given).
-- The record keeps the highest token that wrote to it in its field "fence". A write with a
-- lower token is ignored (its run lost the claim: its consumer was presumed dead and the task
-- re-run or requeued); a write with a higher token takes the record over.
-- A write with a higher token that sets status RUNNING starts a run: it is refused, and nothing
-- is written, if the task was cancelled (status CANCELLED, or a non-empty cancel_requested_at_ms
-- left by a cancel of an earlier run, which then makes the record CANCELLED): the consumer drops
-- the task unrun.
-- Returns: 1 written, 0 ignored, 2 refused: the task was cancelled.

-- include: args
local token = tonumber(ARGV[4])
if token then
  local current = tonumber(redis.call('HGET', KEYS[1], 'fence')) or 0
  if token < current then
    return 0
  end
  local starts = false
  for i = 5, #ARGV - 1, 2 do
    if ARGV[i] == 'status' then starts = ARGV[i + 1] == 'RUNNING' end
  end
  if starts and token > current then
    if redis.call('HGET', KEYS[1], 'status') == 'CANCELLED' then return 2 end
    if (redis.call('HGET', KEYS[1], 'cancel_requested_at_ms') or '') ~= '' then
      redis.call('HSET', KEYS[1], 'status', 'CANCELLED', 'finished_at_ms', server_now_ms())
      return 2
    end
  end
end
if #ARGV > 4 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 5))
end
if token then
  redis.call('HSET', KEYS[1], 'fence', ARGV[4])
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
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]) or 604800)
return 1
