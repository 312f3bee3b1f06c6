-- enqueue_unique: push one task unless (for an id the caller chose) a task with its id was
-- enqueued to this queue lately or its record names another queue, or a task of the same type and
-- uniqueness key was enqueued to this queue within the key's window; the checks, the push and the
-- task's history entry are one step.
-- KEYS[1] uniqueness key (string: the id of the task that holds it)   KEYS[2] pending list
-- KEYS[3] prioritized zset   KEYS[4] delayed zset   KEYS[5] enqueued ids zset (task id -> server
-- ms); if ARGV[11] = s > 0, KEYS[6] history zset, KEYS[7] history ids zset and KEYS[8] to
-- KEYS[7 + s] the status indexes of the statuses named in ARGV[14...]; then (optional, single
-- server only) the task's result hash, for its READY record
-- ARGV[1] task id   ARGV[2] window (ms)   ARGV[3] wake token   ARGV[4] priority (-100..100)
-- ARGV[5] delay ms (0 = due now)   ARGV[6] serialized task   ARGV[7] time to live of the record
-- (s)   ARGV[8] "1" if the caller chose the id (checked against, then added to, KEYS[5])
-- ARGV[9] how long enqueued ids are remembered (ms)   ARGV[10] at most how many are remembered
-- ARGV[11] s, the number of status indexes (0: no history index)   ARGV[12] at most how many
-- tasks the history keeps   ARGV[13] its time to live (ms)   ARGV[14] to ARGV[13 + s] the status
-- names; then the record's field/value pairs
-- Returns: {1, task id} pushed; {0, task id} when the caller chose that id and it is taken (enqueued
-- to this queue lately, a retry of the same request; or its record, when given, names another
-- queue than the record to write); else {0, id of the task holding the key} a duplicate: nothing
-- written.
-- Atomic: the push is the first write (out of memory fails it and nothing is written); the record
-- and the index are written with pcall (a record a producer wrote as another type only loses it).

-- include: args
-- include: priority
-- include: history
-- include: task_ids
local index, first = history_args(11, #KEYS - 7)
local record_key = KEYS[index.count > 0 and 8 + index.count or 6]
local last = #ARGV - ((#ARGV - first + 1) % 2)
-- A caller's id names one task: the one enqueued with it lately, or the one its record names.
if ARGV[8] == '1' and (redis.call('ZSCORE', KEYS[5], ARGV[1])
                       or names_another_queue(record_key, pair_value(first, last, 'queue'))) then
  return {0, ARGV[1]}
end
local holder = redis.call('GET', KEYS[1])
if holder then return {0, holder} end
local now_ms = server_now_ms()
if ARGV[8] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. (now_ms - int_arg(ARGV[9], 86400000, 0, 2 ^ 53)))
  local excess = redis.call('ZCARD', KEYS[5]) - int_arg(ARGV[10], 100000, 1, 2 ^ 53)
  if excess > 0 then redis.call('ZREMRANGEBYRANK', KEYS[5], 0, excess - 1) end
end
local priority = int_arg(ARGV[4], 0, -100, 100)
local delay_ms = int_arg(ARGV[5], 0, 0, 2 ^ 53)
if delay_ms > 0 then
  redis.call('ZADD', KEYS[4], now_ms + delay_ms, string.format('%+04d', priority) .. ARGV[6])
elseif priority ~= 0 then
  redis.call('ZADD', KEYS[3], priority_score(priority, now_ms), ARGV[6])
  if redis.call('LLEN', KEYS[2]) == 0 then redis.call('LPUSH', KEYS[2], ARGV[3]) end
else
  redis.call('LPUSH', KEYS[2], ARGV[6])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', int_arg(ARGV[2], 1000, 1, 2 ^ 53))
if ARGV[8] == '1' then redis.call('ZADD', KEYS[5], now_ms, ARGV[1]) end
if index.count > 0 then
  history_enqueued(history_keys(KEYS[6], KEYS[7], index.names, 8), {ARGV[1]}, index.max, index.ttl_ms)
end
if record_key and last > first and type(redis.pcall('HSET', record_key, unpack(ARGV, first, last))) == 'number' then
  redis.pcall('EXPIRE', record_key, int_arg(ARGV[7], 1, 1, 2 ^ 53))
end
return {1, ARGV[1]}
