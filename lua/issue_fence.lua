-- issue_fence: issue fencing tokens for runs of a queue's tasks (claim.lua issues those of the
-- tasks it claims the same way).
-- KEYS[1] fence counter of the queue
-- ARGV[1] how many tokens to issue (n >= 1; anything else counts as 1)
-- Returns: the first token; the n tokens are first .. first + n - 1, each higher than any token
-- issued before, even after a restart that lost the counter.

-- include: args
-- include: fence
return issue_fences(KEYS[1], math.max(1, math.floor(tonumber(ARGV[1]) or 1)))
