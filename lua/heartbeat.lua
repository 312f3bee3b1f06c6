-- heartbeat: register a consumer or renew its live lease on one or more queues, on the server's clock.
-- KEYS[1] consumers zset (id -> lease deadline ms)   KEYS[2] consumer info hash (id -> JSON)
-- KEYS[3] primary marker hash of the queue's slot (replid -> of the node that last served it,
-- since_ms -> when that node began to), read by reap to hold reaping after a failover; then the
-- same three keys of each further queue. On a single server one call renews every queue of a consumer; on Redis Cluster each
-- call holds one queue (its keys share a slot).
-- KEYS[3n + 1] (single server, optional) the lease index zset (id -> its latest deadline ms), written
-- when a lease is held, so that reapers need look at the queues only once a deadline there passed.
-- ARGV[1] consumer id   ARGV[2] lease ms   ARGV[3] info JSON to register with, or "" to renew
-- ARGV[4] (renewals) the renewing process's instance token, or "": a renewal is refused when the
-- registered info names another instance (a process frozen past its lease whose id another
-- process has registered since must not renew it beside that process)
-- ARGV[5] (renewals, optional) the deadline (ms) the renewing process's last renewal of these
-- queues wrote, or "": while a queue's entry still holds that deadline and it has not passed, no one
-- reaped the consumer or registered its id since, and the renewal is one write
-- ARGV[6] (optional) the replication id under which an earlier call checked these queues' primary
-- markers, or "": on that node they need no second look
-- Returns: per queue, 1 lease held, 0 lease lost (the consumer was reaped, its lease expired, or
-- another instance registered its id: it must not use this id again); then the deadline written
-- (ms) and this node's replication id. While reapers hold off (Redis up or primary for less than a
-- lease) an expired lease is still renewed: the outage, not the consumer, let it lapse.
-- include: args
local now_ms = server_now_ms()
local lease_ms = tonumber(ARGV[2]) or 0
-- include: node
-- include: instance
local uptime_ms, replid = node_state()
local deadline_ms = now_ms + lease_ms
local last_deadline_ms = ARGV[3] == '' and tonumber(ARGV[5] or '')
local marked = ARGV[6] == replid

-- When this node began to serve the slot of `primary`, marking it if no one did under this node.
local function serving_since_ms(primary)
  local mark = redis.call('HMGET', primary, 'replid', 'since_ms')
  local since_ms = tonumber(mark[2])
  if mark[1] ~= replid or not since_ms then
    -- No marker yet: this node has served the slot since it started, as far as anyone knows.
    -- Another node's marker: this node took the slot over (a failover) just now.
    since_ms = mark[1] and now_ms or now_ms - uptime_ms
    redis.call('HSET', primary, 'replid', replid, 'since_ms', since_ms)
  end
  return since_ms
end

-- Renew an entry that still holds our last deadline, not yet passed, in one write: true if it did.
-- The increment lands on exactly the new deadline only from that score; from another it is undone.
local function renewed_unchanged(consumers)
  if not last_deadline_ms or last_deadline_ms <= now_ms then return false end
  local step = deadline_ms - last_deadline_ms
  local score = redis.call('ZADD', consumers, 'XX', 'INCR', step, ARGV[1])
  if not score or tonumber(score) == deadline_ms then return score ~= false end
  redis.call('ZADD', consumers, tonumber(score) - step, ARGV[1])
  return false
end

-- The lease on the queue of keys `consumers`, `info` and `primary`: 1 held (renewed or registered), 0 lost.
local function renew(consumers, info, primary)
  local since_ms = not marked and serving_since_ms(primary) or nil
  if renewed_unchanged(consumers) then return 1 end
  since_ms = since_ms or serving_since_ms(primary)
  local holding = uptime_ms < lease_ms or now_ms - since_ms < lease_ms
  if ARGV[3] ~= '' then
    redis.call('HSET', info, ARGV[1], ARGV[3])
  else
    local deadline = tonumber(redis.call('ZSCORE', consumers, ARGV[1]))
    if not deadline or (deadline <= now_ms and not holding) then
      return 0
    end
    if other_instance(info, ARGV[1], ARGV[4]) then
      return 0
    end
  end
  redis.call('ZADD', consumers, deadline_ms, ARGV[1])
  return 1
end

local held = {}
local any_held = false
for at = 1, #KEYS - 2, 3 do
  held[#held + 1] = renew(KEYS[at], KEYS[at + 1], KEYS[at + 2])
  any_held = any_held or held[#held] == 1
end
if #KEYS % 3 == 1 and any_held then
  redis.call('ZADD', KEYS[#KEYS], deadline_ms, ARGV[1])
end
held[#held + 1] = deadline_ms
held[#held + 1] = replid
return held
