-- heartbeat: register a consumer or renew its live lease on one or more queues, on the server's clock.
-- KEYS[1] consumers zset (id -> lease deadline ms)   KEYS[2] consumer info hash (id -> JSON)
-- KEYS[3] primary marker hash of the queue's slot (replid -> of the node that last served it,
-- since_ms -> when that node began to), read by reap to hold reaping after a failover; then the
-- same three keys of each further queue. On a single server one call renews every queue of a consumer; on Redis Cluster each
-- call holds one queue (its keys share a slot).
-- ARGV[1] consumer id   ARGV[2] lease ms   ARGV[3] info JSON to register with, or "" to renew
-- ARGV[4] (renewals) the renewing process's instance token, or "": a renewal is refused when the
-- registered info names another instance (a process frozen past its lease whose id another
-- process has registered since must not renew it beside that process)
-- Returns: per queue, 1 lease held, 0 lease lost (the consumer was reaped, its lease expired, or
-- another instance registered its id: it must not use this id again). While reapers hold off
-- (Redis up or primary for less than a lease) an expired lease is still renewed: the outage,
-- not the consumer, let it lapse.
-- include: args
local now_ms = server_now_ms()
local lease_ms = tonumber(ARGV[2]) or 0
-- include: node
-- include: instance
local uptime_ms, replid = node_state()

-- The lease on the queue of keys `consumers`, `info` and `primary`: 1 held (renewed or registered), 0 lost.
local function renew(consumers, info, primary)
  local mark = redis.call('HMGET', primary, 'replid', 'since_ms')
  local since_ms = tonumber(mark[2])
  if mark[1] ~= replid or not since_ms then
    -- No marker yet: this node has served the slot since it started, as far as anyone knows.
    -- Another node's marker: this node took the slot over (a failover) just now.
    since_ms = mark[1] and now_ms or now_ms - uptime_ms
    redis.call('HSET', primary, 'replid', replid, 'since_ms', since_ms)
  end
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
  redis.call('ZADD', consumers, now_ms + lease_ms, ARGV[1])
  return 1
end

local held = {}
for at = 1, #KEYS - 2, 3 do
  held[#held + 1] = renew(KEYS[at], KEYS[at + 1], KEYS[at + 2])
end
return held
