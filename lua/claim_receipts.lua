-- claim_receipts: tell the records of freshly claimed tasks which claim holds them, before any
-- of them starts, and learn which were cancelled (see cancel.lua).
-- KEYS[1] to KEYS[n] the result hashes of the tasks
-- ARGV[1] time to live of the records (s)   ARGV[2..n+1] the fencing token of each task's claim
-- Per task: a record whose fence is above the token belongs to a later claim (nothing written);
-- a cancelled task's receipt is refused (include/start_gate.lua: nothing written, or the record
-- made CANCELLED); else claimed_fence and fence are set to the token, which the run's RUNNING
-- write then carries (never refused). A missing record is created with those two fields (the
-- RUNNING write then fills in the task's own).
-- Returns: one reply per task: 1 held by this claim, 3 held, its record created here, 0 a later
-- claim holds it, 2 refused (the task was cancelled: it must not run), -1 not a record (a key a
-- producer wrote as another type: nothing done).

-- include: args
-- include: start_gate
local ttl_s = int_arg(ARGV[1], 604800, 1, 2 ^ 31)
local replies = {}
for i, key in ipairs(KEYS) do
  local token = tonumber(ARGV[i + 1]) or 0
  local current = redis.pcall('HMGET', key, 'fence', 'status', 'cancel_requested_at_ms', 'type')
  if type(current) ~= 'table' or current.err then
    replies[i] = -1
  elseif token < (stored_int(current[1]) or 0) then
    replies[i] = 0
  elseif cancelled_before_start(key, current[2] or 'READY', current[3]) then
    replies[i] = 2
  else
    -- 1 only for a record that holds the task's own fields (a producer's READY record or a run's
    -- write): one an earlier receipt created holds only claimed_fence and fence.
    replies[i] = current[4] and 1 or 3
    redis.call('HSET', key, 'claimed_fence', token, 'fence', token)
    redis.call('EXPIRE', key, ttl_s)
  end
end
return replies
