-- Freeing a uniqueness key (unique_until = finished) that task `id` still holds: now, or with
-- `after_ms` > 0 that many ms from now (a key due to lapse sooner keeps its own time: it never
-- outlives its window). Returns 1 freed (or due to be), 0 when the key is gone or holds another
-- task's id (left alone). Needs the args include before it (int_arg).
local function free_unique(key, id, after_ms)
  if redis.call('GET', key) ~= id then
    return 0
  end
  after_ms = int_arg(after_ms, 0, 0, 2 ^ 53)
  if after_ms == 0 then
    return redis.call('DEL', key)
  end
  local left_ms = redis.call('PTTL', key)
  if left_ms < 0 or left_ms > after_ms then
    redis.call('PEXPIRE', key, after_ms)
  end
  return 1
end
