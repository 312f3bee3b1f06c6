-- A periodic schedule's slot claim (a hash of its own, whatever queue it fires into): slot_ms, the
-- latest slot claimed, queue, the queue that fires it, and before_ms, before_queue, the slot claimed
-- before it and its queue. Needs args (stored_int).
-- Which queue fires slot `slot_ms` of the schedule: the first caller asking for a slot after the
-- last one claimed names it (`queue`, the one its rows say); every later caller for that slot is
-- told the same, so one queue's state (and script) decides the slot, whatever rows a consumer read.
-- Returns that queue (nil: a later slot was claimed already, this one is not fired any more), the
-- slot claimed before it if that went to another queue (0: none): its runs are not this queue's to
-- catch up, and whether this slot was claimed before this call.
local function claim_periodic_slot(key, slot_ms, queue)
  local claim = redis.call('HMGET', key, 'slot_ms', 'queue', 'before_ms', 'before_queue')
  local claimed = stored_int(claim[1])
  if claimed and claim[2] and slot_ms < claimed then return nil, 0 end
  local before_ms, before_queue = claimed, claim[2]
  local again = claimed ~= nil and claim[2] ~= false and slot_ms == claimed
  if again then
    queue, before_ms, before_queue = claim[2], stored_int(claim[3]), claim[4]
  else
    redis.call('HSET', key, 'slot_ms', slot_ms, 'queue', queue, 'before_ms', before_ms or '', 'before_queue', before_queue or '')
  end
  if before_ms and before_queue and before_queue ~= queue then return queue, before_ms, again end
  return queue, 0, again
end
