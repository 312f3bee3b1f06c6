-- delete_finished: delete the result records of finished tasks, each judged by its record as it is now.
-- KEYS[1] to KEYS[n] the result hashes of the tasks
-- A record is deleted if its status is SUCCESSFUL or FAILED, or CANCELLED with cancelled_waiting
-- empty. A record that moved on since the caller read it (a dead task requeued: READY again) is
-- kept, and so is that of a task cancelled where it waited (cancel.lua marks it) until a consumer
-- has claimed and dropped it: a claim's receipt that finds no record creates one and the task
-- would run (claim_receipts.lua).
-- Returns: per task 1 deleted, 0 no record, 2 kept (not finished, or cancelled and still
-- waiting), -1 not a hash (left alone).

local replies = {}
for i, key in ipairs(KEYS) do
  local fields = redis.pcall('HMGET', key, 'status', 'cancelled_waiting')
  if type(fields) ~= 'table' or fields.err then
    replies[i] = -1
  elseif redis.call('EXISTS', key) == 0 then
    replies[i] = 0
  else
    local status = fields[1] or 'READY'
    if status == 'SUCCESSFUL' or status == 'FAILED' or (status == 'CANCELLED' and (fields[2] or '') == '') then
      redis.call('DEL', key)
      replies[i] = 1
    else
      replies[i] = 2
    end
  end
end
return replies
