-- cancel: cancel a task through its result record, the one place where its start is decided.
-- KEYS[1] the task's result hash
-- ARGV[1] who cancels (free text, stored as cancelled_by)
-- A READY task that no consumer holds (pending, prioritized, delayed, waiting for a retry,
-- deferred) becomes CANCELLED at once: record_result refuses the receipt or RUNNING write that
-- would start it, so the consumer that claims it drops it unrun. It stays where it waits until
-- then, its record marked cancelled_waiting (emptied by the drop's write): a delete of the
-- record (delete_finished.lua) keeps it, since a claim that finds no record runs the task. A task a consumer claimed
-- (its receipt left claimed_fence) or runs gets cancel_requested_at_ms: that consumer tells its
-- handler (context.cancelled) once it runs, and no later run of it starts.
-- Returns: {outcome, queue, status, server ms[, unique digest]}: outcome "cancelled" (it will
-- never run), "requested" (claimed or running: asked to stop; ms of the first request),
-- "finished" (SUCCESSFUL, FAILED, CANCELLED or any other status: nothing done), "unknown" (no
-- record, or a key of another type: nothing done; queue and status "", ms 0); only "cancelled"
-- has the fifth element, the record's unique_digest ("" if none: the caller frees that
-- uniqueness key, as the task ended).

-- include: args
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'hash' then return {'unknown', '', '', 0} end
local queue = redis.call('HGET', KEYS[1], 'queue') or ''
local fields = redis.call('HMGET', KEYS[1], 'status', 'claimed_fence')
local status = fields[1] or 'READY'
local claimed = (fields[2] or '') ~= ''
local now_ms = server_now_ms()
if status == 'READY' and not claimed then
  redis.call('HSET', KEYS[1], 'status', 'CANCELLED', 'cancelled_by', ARGV[1],
             'cancelled_at_ms', now_ms, 'finished_at_ms', now_ms, 'cancelled_waiting', '1')
  return {'cancelled', queue, 'CANCELLED', now_ms, redis.call('HGET', KEYS[1], 'unique_digest') or ''}
end
if status == 'RUNNING' or status == 'READY' then
  local requested = tonumber(redis.call('HGET', KEYS[1], 'cancel_requested_at_ms') or '')
  if not requested then
    requested = now_ms
    redis.call('HSET', KEYS[1], 'cancel_requested_at_ms', now_ms, 'cancelled_by', ARGV[1])
  end
  return {'requested', queue, status, requested}
end
return {'finished', queue, status, now_ms}
