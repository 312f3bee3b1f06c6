-- cancel: cancel a task through its result record, the one place where its start is decided.
-- KEYS[1] the task's result hash; then (one server) KEYS[2] the waiting marks' bucket hash of its id
-- ARGV[1] who cancels (free text, stored as cancelled_by)   ARGV[2] time to live (s) of a record
-- made from a mark   ARGV[3] the mark's field (one server: read here); or (Redis Cluster, no
-- KEYS[2]) ARGV[3] the queue and ARGV[4] the type the mark named when the caller read it ("": none)
-- A READY task that no consumer holds (pending, prioritized, delayed, waiting for a retry,
-- deferred) becomes CANCELLED at once: record_result refuses the receipt or RUNNING write that
-- would start it, so the consumer that claims it drops it unrun. A waiting task without a record
-- (its waiting mark holds its queue and type) gets a CANCELLED record, and its mark goes (on Redis
-- Cluster the caller deletes it after). It stays where it waits until then, its record marked
-- cancelled_waiting (emptied by the drop's write): a delete of the
-- record (delete_finished.lua) keeps it, since a claim that finds no record runs the task. A task a consumer claimed
-- (its receipt left claimed_fence) or runs gets cancel_requested_at_ms: that consumer tells its
-- handler (context.cancelled) once it runs, and no later run of it starts.
-- Returns: {outcome, queue, status, server ms[, unique digest]}: outcome "cancelled" (it will
-- never run), "requested" (claimed or running: asked to stop; ms of the first request),
-- "finished" (SUCCESSFUL, FAILED, CANCELLED or any other status: nothing done), "unknown" (no
-- record nor mark, or a key of another type: nothing done; queue and status "", ms 0); only "cancelled"
-- has the fifth element, the record's unique_digest ("" if none: the caller frees that
-- uniqueness key, as the task ended).

-- include: args
local kind = redis.call('TYPE', KEYS[1]).ok
local now_ms = server_now_ms()
if kind == 'none' then
  local queue, task_type = ARGV[3] or '', ARGV[4] or ''
  if KEYS[2] then
    local mark = redis.call('HGET', KEYS[2], ARGV[3]) or ''
    queue, task_type = string.match(mark, '^(%S*) (%S*)$')
    redis.call('HDEL', KEYS[2], ARGV[3])
  end
  if (queue or '') == '' then return {'unknown', '', '', 0} end
  redis.call('HSET', KEYS[1], 'queue', queue, 'type', task_type, 'status', 'CANCELLED', 'cancelled_by', ARGV[1],
             'cancelled_at_ms', now_ms, 'finished_at_ms', now_ms, 'cancelled_waiting', '1')
  redis.call('EXPIRE', KEYS[1], int_arg(ARGV[2], 604800, 1, 2 ^ 31))
  return {'cancelled', queue, 'CANCELLED', now_ms, ''}
end
if kind ~= 'hash' then return {'unknown', '', '', 0} end
local queue = redis.call('HGET', KEYS[1], 'queue') or ''
local fields = redis.call('HMGET', KEYS[1], 'status', 'claimed_fence')
local status = fields[1] or 'READY'
local claimed = (fields[2] or '') ~= ''
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
