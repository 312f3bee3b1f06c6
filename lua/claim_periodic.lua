-- claim_periodic: on Redis Cluster, where a schedule's slot claim and the queue it fires into lie in
-- different slots, name the queue that fires one slot of a periodic schedule, before fire_periodic
-- runs there (on a single server fire_periodic makes the claim itself, in the same call).
-- KEYS[1] the schedule's slot claim (hash: slot_ms, queue, before_ms, before_queue)
-- ARGV[1] slot (ms since the epoch)   ARGV[2] the queue the caller's rows name
-- Returns: {outcome, queue, the slot claimed before for another queue (ms; 0: none), server now ms}
-- where outcome is "early" (the slot is after the server's now: nothing written), "done" (a later
-- slot was claimed: this one is not fired any more) or "claimed" (fire it in `queue`, which the
-- first caller for this slot named: the caller's own, or another).

-- include: args
-- include: periodic_slot
-- include: periodic_claim
local now_ms = server_now_ms()
local slot_ms = int_arg(ARGV[1], -1, -1, 2 ^ 53)
if slot_ms < 0 then return redis.error_reply('ERR claim_periodic: the slot must be a number of ms') end
if now_ms < slot_ms then return {'early', '', 0, now_ms} end
local queue, before_ms = claim_periodic_slot(KEYS[1], slot_ms, ARGV[2] or '')
if not queue then return {'done', '', 0, now_ms} end
return {'claimed', queue, before_ms, now_ms}
