-- Fencing tokens of a queue's runs: each higher than any issued before, also after a restart
-- that lost the counter (the count then restarts from the server clock in microseconds).
-- Needs the args include before it (server_now_us).
local function issue_fences(counter_key, count)
  local now_us = server_now_us()
  local first = math.max(stored_int(redis.call('GET', counter_key)) or 0, now_us) + 1
  redis.call('SET', counter_key, string.format('%.0f', first + count - 1))
  return first
end
