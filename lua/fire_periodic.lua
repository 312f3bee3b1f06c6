-- fire_periodic: claim one slot of a periodic schedule and push its task, in one call, so any
-- number of consumers fire each slot once and a consumer dying mid-way loses or doubles nothing.
-- KEYS[1] the schedule's state hash in this queue   KEYS[2] pending list   KEYS[3] prioritized
-- zset; if ARGV[15] = s > 0, KEYS[4] history zset, KEYS[5] history ids zset and KEYS[6] to
-- KEYS[5 + s] the status indexes of the statuses named in ARGV[18...]; then the regular run's
-- result hash, the catch-up run's and the schedule's slot claim (all three optional: a single
-- Redis server only, as they lie in other slots; on Redis Cluster the caller writes the records
-- and claims the slot first, with claim_periodic)
-- ARGV[1] slot (ms since the epoch)   ARGV[2] the slot before it (ms; 0 = none)   ARGV[3] how
-- late (ms) the slot may be and still run as itself   ARGV[4] catch-up policy: "skip" or "once"
-- ARGV[5] wake token   ARGV[6] priority (-100..100)   ARGV[7] regular task id   ARGV[8] regular
-- task   ARGV[9] catch-up task id   ARGV[10] catch-up task ("" for none)   ARGV[11] record time to
-- live (s)   ARGV[12] when the schedule was last saved (ms; slots up to then never run, on time
-- or caught up: it may have been disabled, or have run them in another queue)   ARGV[13] this
-- queue's name   ARGV[14] the slot claimed before this one for another queue (ms; 0 none: read
-- from the claim when it is among the KEYS), whose runs are not caught up here   ARGV[15] s, the
-- number of status indexes (0: no history index)   ARGV[16] at most how many tasks the history
-- keeps   ARGV[17] its time to live (ms)   ARGV[18] to ARGV[17 + s] the status names; then the
-- READY record's field/value pairs (the same for both runs). Each run pushed is added to the
-- history index as READY (the catch-up run first).
-- Returns: {outcome, server now ms, last slot handled ms, last fired slot ms} where outcome is
-- "early" (the slot is after the server's now: nothing done), "done" (this slot or a later one
-- was handled already, or a later one claimed), "fired", "caught_up" (one run for the missed
-- slots, this one among them), "fired_and_caught_up" (a catch-up run, then this slot's) or
-- "skipped" (late: recorded, nothing pushed); or {"elsewhere", now, last handled, last fired,
-- queue}: the claim names another queue for this slot (nothing written), fire it there.
-- The state hash: slot_ms (last slot handled), fired_slot_ms, task_id and fired_at_ms (server
-- ms) of the last run pushed. A slot at or before slot_ms is never pushed again.

-- include: args
-- include: priority
-- include: history
-- include: periodic_slot
-- include: periodic_claim
local slot_ms, now_ms, last, fired, refused = periodic_slot('fire_periodic')
if refused then return refused end
local index, first_field = history_args(15, #KEYS - 5)
local result_keys = index.count > 0 and 6 + index.count or 4
local elsewhere_ms = int_arg(ARGV[14], 0, 0, 2 ^ 53)
redis.call('LLEN', KEYS[2]); redis.call('ZCARD', KEYS[3])  -- types checked before the slot is claimed
if KEYS[result_keys + 2] then
  local queue, again
  queue, elsewhere_ms, again = claim_periodic_slot(KEYS[result_keys + 2], slot_ms, ARGV[13] or '')
  if not queue then return {'done', now_ms, slot_ms, fired} end
  if queue ~= ARGV[13] then return {'elsewhere', now_ms, last or -1, fired, queue} end
  -- Claimed in an earlier call of this script, which handled it in this queue: its state, which
  -- does not say so, was lost (deleted, evicted), and the claim alone keeps the slot single.
  if again then return {'done', now_ms, slot_ms, fired} end
end

local prev_ms = int_arg(ARGV[2], 0, 0, 2 ^ 53)
local saved_ms = int_arg(ARGV[12], 0, 0, 2 ^ 53)
-- A slot at or before the schedule's last save never runs: a new schedule has no past (nor one
-- re-created under a deleted one's name), and one just moved to this queue, back to it too, may
-- have fired that slot in the queue it left.
local on_time = now_ms - slot_ms <= int_arg(ARGV[3], 0, 0, 2 ^ 53) and slot_ms > saved_ms
-- Missed: a slot after the last handled one and after the schedule's last save (before it, it may
-- have been disabled) was never handled: the one before this, or this one, too late to run as
-- itself. Without a history (a new schedule) nothing counts as missed.
-- Nor a slot up to one fired in another queue (claimed for it): that queue handled it.
local missed = last ~= nil and (prev_ms > math.max(last, saved_ms, elsewhere_ms) or (not on_time and slot_ms > saved_ms))
local catch_up = missed and ARGV[4] == 'once' and ARGV[10] ~= ''
local priority = int_arg(ARGV[6], 0, -100, 100)
local ttl_s = int_arg(ARGV[11], 1, 1, 2 ^ 53)
local pushed_ids = {}

local function push(task, id, record_key, offset_ms)
  if priority == 0 then
    redis.call('LPUSH', KEYS[2], task)
  else
    redis.call('ZADD', KEYS[3], priority_score(priority, now_ms - offset_ms), task)
    if redis.call('LLEN', KEYS[2]) == 0 then redis.call('LPUSH', KEYS[2], ARGV[5]) end
  end
  pushed_ids[#pushed_ids + 1] = id
  if record_key and #ARGV > first_field then
    local written = redis.pcall('HSET', record_key, unpack(ARGV, first_field, #ARGV - ((#ARGV - first_field + 1) % 2)))
    if type(written) == 'number' then redis.pcall('EXPIRE', record_key, ttl_s) end
  end
end

local outcome = 'skipped'
local task_id
if catch_up then
  push(ARGV[10], ARGV[9], KEYS[result_keys + 1], 1)  -- the older run first
  outcome, task_id = 'caught_up', ARGV[9]
end
if on_time then
  push(ARGV[8], ARGV[7], KEYS[result_keys], 0)
  outcome, task_id = catch_up and 'fired_and_caught_up' or 'fired', ARGV[7]
end
if index.count > 0 and #pushed_ids > 0 then
  history_enqueued(history_keys(KEYS[4], KEYS[5], index.names, 6), pushed_ids, index.max, index.ttl_ms)
end
redis.call('HSET', KEYS[1], 'slot_ms', slot_ms)
if task_id then
  fired = slot_ms
  redis.call('HSET', KEYS[1], 'fired_slot_ms', slot_ms, 'task_id', task_id, 'fired_at_ms', now_ms)
end
return {outcome, now_ms, slot_ms, fired}
