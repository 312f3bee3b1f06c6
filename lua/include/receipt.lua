-- A claim's receipt on the record `key` of a freshly claimed task (see claim_receipts.lua): a
-- record whose fence is above `token` belongs to a later claim (nothing written); a cancelled
-- task's receipt is refused (include/start_gate.lua); else claimed_fence and fence are set to
-- the token. A missing record is created with those two fields, and `queue` and `task_type`.
-- Needs the args and start_gate includes before it.
-- Returns: 1 held by this claim, 3 held, its record created here, 0 a later claim holds it, 2
-- refused (cancelled: it must not run), -1 not a record (a key of another type: nothing done).
local function write_receipt(key, token, ttl_s, queue, task_type)
  local current = redis.pcall('HMGET', key, 'fence', 'status', 'cancel_requested_at_ms', 'enqueued_at_ms', 'queue')
  if type(current) ~= 'table' or current.err then return -1 end
  if token < (stored_int(current[1]) or 0) then return 0 end
  if cancelled_before_start(key, current[2] or 'READY', current[3]) then return 2 end
  redis.call('HSET', key, 'claimed_fence', token, 'fence', token)
  if not current[5] and queue ~= '' then
    redis.call('HSET', key, 'queue', queue, 'type', task_type)
  end
  redis.call('EXPIRE', key, ttl_s)
  -- 1 only for a record that holds the task's own fields (a producer's READY record or a run's
  -- write): one an earlier receipt created holds only the fences, queue and type.
  return current[4] and 1 or 3
end
