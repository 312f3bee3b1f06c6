-- skip_periodic: record one slot of a periodic schedule as handled, pushing nothing: its task type
-- is disabled, so the slot was refused, not missed, and no catch-up run stands for it later.
-- KEYS[1] the schedule's state hash (see fire_periodic)
-- ARGV[1] slot (ms since the epoch)
-- Returns: {outcome, server now ms, last slot handled ms, last fired slot ms} as fire_periodic
-- does, where outcome is "early" (the slot is after the server's now: nothing done), "done" (this
-- slot or a later one was handled already) or "skipped" (the slot is recorded as handled).

-- include: args
-- include: periodic_slot
local slot_ms, now_ms, _, fired, refused = periodic_slot('skip_periodic')
if refused then return refused end
redis.call('HSET', KEYS[1], 'slot_ms', slot_ms)
return {'skipped', now_ms, slot_ms, fired}
