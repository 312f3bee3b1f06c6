-- release_unique: free a uniqueness key early (unique_until = finished), if this task still holds it.
-- KEYS[1] uniqueness key
-- ARGV[1] id of the task that finished
-- Returns: 1 released, 0 the key is gone or held by another task (left alone).
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
