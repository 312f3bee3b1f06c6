-- issue_fence: issue fencing tokens for runs of a queue's tasks (see claim.lua, which does the
-- same for the tasks it claims).
-- KEYS[1] fence counter of the queue
-- ARGV[1] how many tokens to issue (n >= 1)
-- Returns: the first token; the n tokens are first .. first + n - 1, each higher than any token
-- issued before, even after a restart that lost the counter: the count starts from the server
-- clock in microseconds whenever that is ahead.
local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local base = math.max(tonumber(redis.call('GET', KEYS[1])) or 0, now_us)
local count = math.max(1, math.floor(tonumber(ARGV[1]) or 1))
redis.call('SET', KEYS[1], string.format('%.0f', base + count))
return base + 1
