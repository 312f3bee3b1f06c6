-- The start of a run (its claim's receipt, or a RUNNING write with a token above the record's
-- fence) is refused when the task was cancelled: its status is CANCELLED, or a cancel was
-- requested while an earlier claim held it (cancel_requested_at_ms), which makes the record
-- CANCELLED here. Needs the args include before it.
local function cancelled_before_start(key, status, cancel_requested)
  if status == 'CANCELLED' then return true end
  if (cancel_requested or '') == '' then return false end
  redis.call('HSET', key, 'status', 'CANCELLED', 'finished_at_ms', server_now_ms())
  return true
end
