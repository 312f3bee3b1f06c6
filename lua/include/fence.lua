-- Fencing tokens of a queue's runs: each higher than any issued before, also after a restart
-- that lost the counter (the count then restarts from the server clock in microseconds). A
-- counter another writer left that is not a whole number up to 2^53 ("nan", "inf", 1e30) counts
-- as lost: past 2^53 a token would equal the one before it, and such a counter fenced out the
-- records of every claim.
-- Needs the args include before it (server_now_us).
local function issue_fences(counter_key, count)
  local now_us = server_now_us()
  local first = math.max(stored_int(redis.call('GET', counter_key)) or 0, now_us) + 1
  redis.call('SET', counter_key, string.format('%.0f', first + count - 1))
  return first
end
