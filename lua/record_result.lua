-- record_result: update a task's result record, appending to its JSON lists.
-- KEYS[1] result hash
-- ARGV[1] time to live (s)   ARGV[2] worker id to append, or ""   ARGV[3] error JSON object to
-- append, or ""   ARGV[4] run token this update belongs to, or "" (unconditional); then
-- field/value pairs to set (values are stored as given). A run claims the record by setting
-- its field "run" (when it starts).
-- Returns: 1 written, 0 ignored: the record belongs to a later run (this one's consumer was
-- presumed dead and the task re-run), so this late outcome must not overwrite it.
if ARGV[4] ~= '' then
  local current = redis.call('HGET', KEYS[1], 'run')
  local claims = false
  for i = 5, #ARGV, 2 do
    if ARGV[i] == 'run' then claims = true end
  end
  if current and current ~= ARGV[4] and not claims then
    return 0
  end
end
if #ARGV > 4 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 5))
end
local function append(field, item)
  local current = redis.call('HGET', KEYS[1], field)
  local list = current and cjson.decode(current) or {}
  list[#list + 1] = item
  redis.call('HSET', KEYS[1], field, cjson.encode(list))
end
if ARGV[2] ~= '' then append('worker_ids', ARGV[2]) end
if ARGV[3] ~= '' then append('errors', cjson.decode(ARGV[3])) end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
