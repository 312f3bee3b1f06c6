-- Concurrency slots (acquire_slot, wait_for_slot, release_slot): KEYS[1] the slots zset (members
-- "h:<holder token>" of running tasks and "w:<waiter id>" of woken waiters on their way, scored by
-- the deadline in ms after which the entry no longer counts), KEYS[2] the waiters zset (waiter
-- id -> order it first waited in), KEYS[3] the waiting hash (waiter id -> "<queue>\n<delayed
-- member>": where its task sits). All three share the type's (or type|key value's) hash tag.
local SLOTS, WAITERS, WAITING = KEYS[1], KEYS[2], KEYS[3]

-- Holders whose consumer stopped renewing (it died), and woken waiters that never came; true if
-- the entries left can be trusted. Not while Redis has been up for less than a lease (`lease_ms`,
-- the caller's): deadlines passed while it was down, and holders it lost (writes since the last
-- fsync, keys that expired as idle meanwhile) belong to runs that go on. Live consumers renew
-- their holders within a lease (renew_slots puts lost ones back then), as they renew their
-- leases; until then nothing is evicted and no slot is given out. (Needs include node.)
local function evict_expired(now_ms, lease_ms)
  if node_state() < lease_ms then return false end
  redis.call('ZREMRANGEBYSCORE', SLOTS, '-inf', now_ms)
  return true
end

-- Hand each free slot to the oldest waiter: it is reserved for that waiter (which is returned,
-- for the caller to move its task from delayed to pending) until `reserve_ms` from now. At most
-- 100 a call, so a limit raised a lot wakes its waiters over a few calls, never in one long one.
local function wake_waiters(limit, now_ms, reserve_ms)
  local woken = {}
  while #woken < 100 and redis.call('ZCARD', SLOTS) < limit do
    local popped = redis.call('ZPOPMIN', WAITERS)
    if not popped[1] then break end
    local where = redis.call('HGET', WAITING, popped[1])
    redis.call('HDEL', WAITING, popped[1])
    if where then
      redis.call('ZADD', SLOTS, now_ms + reserve_ms, 'w:' .. popped[1])
      woken[#woken + 1] = where
    end
  end
  return woken
end

-- Idle keys go away: every write keeps all three for `idle_ms` more.
local function keep(idle_ms)
  for _, key in ipairs({SLOTS, WAITERS, WAITING}) do
    redis.call('PEXPIRE', key, idle_ms)
  end
end
