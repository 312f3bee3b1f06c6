-- record_result: update a task's result record, appending to its JSON lists.
-- KEYS[1] result hash
-- ARGV[1] time to live (s)   ARGV[2] worker id to append, or ""   ARGV[3] error JSON object to
-- append, or ""; then field/value pairs to set (values are stored as given).
-- Returns: 1.
if #ARGV > 3 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 4))
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
