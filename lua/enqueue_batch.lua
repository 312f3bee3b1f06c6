-- enqueue_batch: push a batch of tasks and write their READY records, all or nothing.
-- KEYS[1] to KEYS[4] for the first queue section, 4 more for each further one: pending list,
-- prioritized zset, delayed zset, enqueued ids zset (task id -> server ms, for ids given by the
-- caller); then, if ARGV[4] is "1", the queue set; then the result hashes of the READY records.
-- ARGV[1] wake token   ARGV[2] how long enqueued ids are remembered (ms)   ARGV[3] at most how
-- many are remembered per queue   ARGV[4] "1" to add the queue names to the queue set
-- ARGV[5] q, the number of queue sections; then each section: queue name, n, n tasks with
-- priority 0, due now and no id to check; m, then m groups of 4: id to check ("" none),
-- priority (-100..100), delay ms (0 = due now), task. Then the records: groups of (number of
-- keys, time to live s, p, then p field/value pairs) until the end.
-- Returns: the number of tasks pushed (a task whose id was enqueued before is skipped).
-- Atomic: the only write that can fail is the first (Redis out of memory, so nothing is written)
-- and nothing after it raises: key types are checked first, records are written with pcall.
-- Keys of different slots (queues, result hashes) are passed on a single Redis server only;
-- on Redis Cluster each call holds one queue section or one record.

-- include: args
-- include: priority
local now_ms = server_now_ms()
local keep_ms = int_arg(ARGV[2], 86400000, 0, 2 ^ 53)
local keep_max = int_arg(ARGV[3], 100000, 1, 2 ^ 53)
local sections = int_arg(ARGV[5], 0, 0, #KEYS / 4)
local wanted = {'list', 'zset', 'zset', 'zset'}
for s = 1, sections do
  for k = 1, 4 do
    local found = redis.call('TYPE', KEYS[4 * s - 4 + k])['ok']
    if found ~= 'none' and found ~= wanted[k] then
      return redis.error_reply('WRONGTYPE ' .. KEYS[4 * s - 4 + k] .. ' is a ' .. found .. ', not a ' .. wanted[k])
    end
  end
end

local pushed = 0
local function push_plain(pending, first, last)
  -- unpack is limited to a few thousand values: push in chunks.
  for from = first, last, 1000 do
    pushed = pushed + math.min(1000, last - from + 1)
    redis.call('LPUSH', pending, unpack(ARGV, from, math.min(last, from + 999)))
  end
end

local function seen_before(ids_key, id)
  if id == '' then return false end
  if redis.call('ZSCORE', ids_key, id) then return true end
  redis.call('ZADD', ids_key, now_ms, id)
  return false
end

-- Push one task of section s; returns whether it was pushed and whether it went to prioritized.
local function push_other(s, id, priority, delay_ms, task)
  if seen_before(KEYS[4 * s], id) then return false, false end
  if delay_ms > 0 then
    redis.call('ZADD', KEYS[4 * s - 1], now_ms + delay_ms, string.format('%+04d', priority) .. task)
  elseif priority ~= 0 then
    redis.call('ZADD', KEYS[4 * s - 2], priority_score(priority, now_ms), task)
    return true, true
  else
    redis.call('LPUSH', KEYS[4 * s - 3], task)
  end
  return true, false
end

local at = 6
for s = 1, sections do
  local name, plain = ARGV[at], int_arg(ARGV[at + 1], 0, 0, #ARGV - at - 1)
  push_plain(KEYS[4 * s - 3], at + 2, at + 1 + plain)
  at = at + 2 + plain
  local others = int_arg(ARGV[at], 0, 0, math.floor((#ARGV - at) / 4))
  local woke = false
  for i = at + 1, at + 4 * others, 4 do
    local added, prioritized = push_other(s, ARGV[i], int_arg(ARGV[i + 1], 0, -100, 100),
                                          int_arg(ARGV[i + 2], 0, 0, 2 ^ 53), ARGV[i + 3])
    if added then pushed = pushed + 1 end
    woke = woke or prioritized
  end
  at = at + 1 + 4 * others
  if woke and redis.call('LLEN', KEYS[4 * s - 3]) == 0 then
    redis.call('LPUSH', KEYS[4 * s - 3], ARGV[1])
  end
  if others > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[4 * s], '-inf', '(' .. (now_ms - keep_ms))
    local excess = redis.call('ZCARD', KEYS[4 * s]) - keep_max
    if excess > 0 then redis.call('ZREMRANGEBYRANK', KEYS[4 * s], 0, excess - 1) end
  end
  if ARGV[4] == '1' and name and KEYS[4 * sections + 1] then
    redis.call('SADD', KEYS[4 * sections + 1], name)
  end
end

-- READY records: a result key of a foreign type only loses its record, the tasks stay pushed;
-- out of memory before anything was written (a call with records only) is the caller's error.
local wrote = pushed > 0
local key = 4 * sections + (ARGV[4] == '1' and 2 or 1)
while at + 2 <= #ARGV and key <= #KEYS do
  local count = int_arg(ARGV[at], 0, 0, #KEYS - key + 1)
  local ttl_s = int_arg(ARGV[at + 1], 1, 1, 2 ^ 53)
  local last = at + 2 + 2 * int_arg(ARGV[at + 2], 0, 0, math.floor((#ARGV - at - 2) / 2))
  for i = key, key + count - 1 do
    if last > at + 2 then
      local outcome = redis.pcall('HSET', KEYS[i], unpack(ARGV, at + 3, last))
      if type(outcome) == 'table' and outcome.err then
        if not wrote and string.find(outcome.err, 'OOM', 1, true) then return outcome end
      else
        wrote = true
        redis.pcall('EXPIRE', KEYS[i], ttl_s)
      end
    end
  end
  key, at = key + count, last + 1
end
return pushed
