-- A caller's task id is taken in every queue but the one its task's record names: the record
-- (P:result:<id>) is one key for the id, so a second task under it would write the first one's.
-- Whether result hash `key` exists naming a queue other than `queue` (a key a producer wrote as
-- another type, or a record without a queue, names none; no `queue` given: false).
local function names_another_queue(key, queue)
  if not key or not queue then return false end
  local owner = redis.pcall('HGET', key, 'queue')
  return type(owner) == 'string' and owner ~= queue
end
-- The value of field `name` among the field/value pairs ARGV[first..last] (nil if absent).
local function pair_value(first, last, name)
  for i = first, last - 1, 2 do
    if ARGV[i] == name then return ARGV[i + 1] end
  end
  return nil
end
