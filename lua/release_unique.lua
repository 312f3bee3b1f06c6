-- release_unique: free a uniqueness key early (unique_until = finished), if this task still holds it.
-- KEYS[1] uniqueness key
-- ARGV[1] id of the task that finished   ARGV[2] (optional) ms from now to free it in, 0 or
-- absent: now (a process that gave up on a hung run frees its keys once it is surely gone; a
-- key due to lapse sooner keeps its own time: it never outlives its window)
-- Returns: 1 released (or due to be), 0 the key is gone or held by another task (left alone).
if redis.call('TYPE', KEYS[1]).ok ~= 'string' or redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local after_ms = math.floor(tonumber(ARGV[2]) or 0)
if after_ms <= 0 then
  return redis.call('DEL', KEYS[1])
end
local left_ms = redis.call('PTTL', KEYS[1])
if left_ms < 0 or left_ms > after_ms then
  redis.call('PEXPIRE', KEYS[1], after_ms)
end
return 1
