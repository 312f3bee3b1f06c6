-- requeue_dead: move dead-lettered tasks back to pending (priority 0) or prioritized (other), the
-- READY record of each written in the same step, only for a task the move took; or park them in
-- delayed (Redis Cluster, where the records lie in other slots: the caller then writes the records
-- of the tasks parked, and moves them on with a second call that takes them from delayed). A task
-- of a unique type takes its uniqueness key as enqueue_unique does, in the same step: a key held by
-- another task leaves it dead.
-- KEYS[1] the zset the tasks come from: the dead zset (the delayed zset for that second call)
-- KEYS[2] pending list   KEYS[3] prioritized zset   KEYS[4] cancel requests zset   KEYS[5] forced
-- cancels zset   KEYS[6] delayed zset; if ARGV[4] = s > 0, KEYS[7] history zset, KEYS[8] history
-- ids zset and KEYS[9] to KEYS[8 + s] the status indexes of the statuses named in ARGV[5...];
-- then u uniqueness keys (strings: the id of the task holding each), one per task with a window,
-- in order; then (single server) the tasks' result hashes, one per task, in order
-- ARGV[1] wake token   ARGV[2] park ms: 0 pushes the tasks; more parks them in delayed, due that
-- long after the server's now, as "<priority as %+04d><task>" (promoted then, should the caller
-- never move them on)   ARGV[3] the records' fencing token (a record holding a higher one is left
-- alone)   ARGV[4] s, the number of status indexes (0: no history index)   ARGV[5] to ARGV[4 + s]
-- their status names   ARGV[5 + s] u, the number of uniqueness keys; then per task: its member as
-- stored in KEYS[1], its priority (-100..100; anything else is clamped, a non-number is 0), the task
-- to push (re-encoded for a fresh start), its id (its cancel requests are dropped: the new run starts
-- afresh), its record's time to live (s), its uniqueness window (ms; 0: none, no key touched; more:
-- the next of the u keys is set to its id with that window as PX, unless another id holds it), p,
-- then p field/value pairs of its READY record (written with `fence` and an empty `claimed_fence`,
-- and filed READY in the history index; p = 0 or no result hash: no record)
-- Returns: one reply per task, 1 moved, 2 moved without the record given for it (its write failed,
-- as on a record a producer wrote as another type, which stops no other task; or a later run's token is on it), 0
-- skipped (no longer in KEYS[1]: requeued by someone else, deleted, trimmed, or promoted once
-- parked; nothing is written for it), or the id of the task holding its uniqueness key (a string:
-- it stays dead, nothing is written for it). The destinations' types are checked before the
-- first task leaves KEYS[1], so a key of the wrong type moves nothing.

-- include: args
-- include: priority
-- include: history
local now_ms = server_now_ms()
local park_ms = int_arg(ARGV[2], 0, 0, 2 ^ 53)
local fence = int_arg(ARGV[3], 0, 0, 2 ^ 53)
local indexes = int_arg(ARGV[4], 0, 0, math.max(0, math.min(#KEYS - 8, #ARGV - 4)))
local h = history_keys(KEYS[7], KEYS[8], {unpack(ARGV, 5, 4 + indexes)}, 9)
local unique_key = indexes > 0 and 9 + indexes or 7
local uniques = int_arg(ARGV[5 + indexes], 0, 0, math.max(0, #KEYS - unique_key + 1))
redis.call('LLEN', KEYS[2]); redis.call('ZCARD', KEYS[3]); redis.call('ZCARD', KEYS[6])
local last_unique_key = unique_key + uniques - 1
local record_key = unique_key + uniques
local at = 6 + indexes

-- Write a READY record (field/value pairs ARGV[from..to]) unless a later run's token is on it;
-- 1 written, 2 not.
local function write_record(key, id, ttl_s, from, to)
  local current = redis.pcall('HGET', key, 'fence')
  if type(current) == 'table' or (stored_int(current) or 0) > fence then return 2 end
  local fields = {unpack(ARGV, from, to)}
  fields[#fields + 1] = 'fence'
  fields[#fields + 1] = fence
  fields[#fields + 1] = 'claimed_fence'
  fields[#fields + 1] = ''
  if type(redis.pcall('HSET', key, unpack(fields))) ~= 'number' then return 2 end
  redis.pcall('EXPIRE', key, ttl_s)
  if indexes > 0 then
    local function enqueued_ms() return tonumber(redis.call('HGET', key, 'enqueued_at_ms')) end
    history_move(h, id, nil, 'READY', enqueued_ms, ttl_s * 1000)
  end
  return 1
end

-- The id of another task than `id` holding uniqueness key `key`; nil if none holds it, or no key.
local function other_holder(key, id)
  local holder = key and redis.call('GET', key)
  if holder and holder ~= id then return holder end
  return nil
end

local requeued = {}
local woke = false
while at + 6 <= #ARGV do
  local priority = int_arg(ARGV[at + 1], 0, -100, 100)
  local task, id = ARGV[at + 2], ARGV[at + 3]
  local window_ms = int_arg(ARGV[at + 5], 0, 0, 2 ^ 53)
  local pairs_count = int_arg(ARGV[at + 6], 0, 0, math.floor((#ARGV - at - 6) / 2))
  local key = nil
  if window_ms > 0 and unique_key <= last_unique_key then
    key = KEYS[unique_key]
    unique_key = unique_key + 1
  end
  local holder = other_holder(key, id)
  if holder and not redis.call('ZSCORE', KEYS[1], ARGV[at]) then holder = nil end  -- no longer dead: skipped
  local moved = holder and 0 or redis.call('ZREM', KEYS[1], ARGV[at])
  if moved > 0 then
    if key then redis.call('SET', key, id, 'PX', window_ms) end
    redis.call('ZREM', KEYS[4], id)
    redis.call('ZREM', KEYS[5], id)
    if KEYS[record_key] and pairs_count > 0 then
      moved = write_record(KEYS[record_key], id, int_arg(ARGV[at + 4], 1, 1, 2 ^ 53), at + 7, at + 6 + 2 * pairs_count)
    end
    if park_ms > 0 then
      redis.call('ZADD', KEYS[6], now_ms + park_ms, string.format('%+04d', priority) .. task)
    elseif priority == 0 then
      redis.call('LPUSH', KEYS[2], task)
    else
      redis.call('ZADD', KEYS[3], priority_score(priority, now_ms), task)
      woke = true
    end
  end
  requeued[#requeued + 1] = holder or moved
  record_key = record_key + 1
  at = at + 7 + 2 * pairs_count
end
history_trim_entered(h)
-- A consumer with nothing to do blocks on the pending list only: a token there wakes it.
if woke and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return requeued
