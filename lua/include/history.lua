-- The history index of one queue (docs/PROTOCOL.md, "History index"): `h` holds its keys,
-- h.all (id -> enqueue ms), h.ids (ids scored 0, for prefix search) and h.status (status name
-- -> key of that status's index; h.status_keys lists them). Every write is a pcall: the index
-- is a view for the pages, written after the task moved, so its failure never undoes a move.
local function history_keys(all, ids, names, first_key)
  local h = {all = all, ids = ids, status = {}, status_keys = {}}
  for i, name in ipairs(names) do
    h.status[name] = KEYS[first_key + i - 1]
    h.status_keys[i] = KEYS[first_key + i - 1]
  end
  return h
end

-- The server's clock in milliseconds with microseconds (a score: two enqueues in one
-- millisecond still sort in order). Needs the args include before it.
local function history_now()
  return server_now_us() / 1000
end

local function history_drop(h, members)
  if #members == 0 then return end
  redis.pcall('ZREM', h.all, unpack(members))
  redis.pcall('ZREM', h.ids, unpack(members))
  for _, key in ipairs(h.status_keys) do redis.pcall('ZREM', key, unpack(members)) end
end

-- Drop entries older than ttl_ms (nil: none) and, once more than max/1000 over the cap, the
-- oldest beyond it (amortized); at most 1000 of each per call.
local function history_trim(h, now_ms, ttl_ms, max)
  if ttl_ms then
    local aged = redis.pcall('ZRANGEBYSCORE', h.all, '-inf', '(' .. (now_ms - ttl_ms), 'LIMIT', 0, 1000)
    if type(aged) == 'table' then history_drop(h, aged) end
  end
  local size = redis.pcall('ZCARD', h.all)
  if type(size) == 'number' and size - max > math.floor(max / 1000) then
    local oldest = redis.pcall('ZRANGE', h.all, 0, math.min(size - max, 1000) - 1)
    if type(oldest) == 'table' then history_drop(h, oldest) end
  end
end

-- Add a task to the index under `status`; false if it was there already (nothing changed).
local function history_add(h, id, score, status)
  if redis.pcall('ZADD', h.all, 'NX', score, id) ~= 1 then return false end
  redis.pcall('ZADD', h.ids, 0, id)
  if h.status[status] then redis.pcall('ZADD', h.status[status], score, id) end
  return true
end

-- Give the index keys `ttl_ms` to live again, unless `all` got it less than a thousandth of it
-- ago (an enqueue then skips seven writes; the consumers' schedulers refresh every key anyway).
local function history_expire(h, ttl_ms)
  local left = redis.pcall('PTTL', h.all)
  if type(left) == 'number' and left > ttl_ms - math.max(1000, math.floor(ttl_ms / 1000)) then return end
  redis.pcall('PEXPIRE', h.all, ttl_ms)
  redis.pcall('PEXPIRE', h.ids, ttl_ms)
  for _, key in ipairs(h.status_keys) do redis.pcall('PEXPIRE', key, ttl_ms) end
end

-- Trim the index as tasks enter it (history_move): to `max` entries (0: not trimmed) and, if
-- `max_age_ms` > 0, to those that young; once a call, by history_trim_entered.
local function history_trim_on_entry(h, max, max_age_ms)
  if max > 0 then h.max = max end
  if max_age_ms > 0 then h.max_age_ms = max_age_ms end
end

-- Once a call in which tasks entered the index (a flush, not each task): trim it if asked to,
-- and renew its keys' time to live.
local function history_trim_entered(h)
  if not h.entered then return end
  if h.max then history_trim(h, server_now_ms(), h.max_age_ms, h.max) end
  history_expire(h, h.expire_ms)
end

-- The index arguments from ARGV[at] on, as tasks_app/protocol/history.py's header_args writes
-- them: s (the number of status indexes, 0 for no index), the cap, the time to live (ms) and s
-- status names (at most `most` of them: the status index keys the script was given). Returns them
-- as a table, and the position of the first argument after them.
local function history_args(at, most)
  local count = int_arg(ARGV[at], 0, 0, math.max(0, math.min(#ARGV - at - 2, most or 2 ^ 53)))
  local shape = {count = count, max = int_arg(ARGV[at + 1], 100000, 1, 2 ^ 53),
                 ttl_ms = int_arg(ARGV[at + 2], 604800000, 1, 2 ^ 53), names = {unpack(ARGV, at + 3, at + 2 + count)}}
  return shape, at + 3 + count
end

-- File tasks just enqueued under READY (scores 1 µs apart, in the order given), then trim the
-- index to `max` entries and `ttl_ms` and give its keys that time to live again.
local function history_enqueued(h, ids, max, ttl_ms)
  local now_ms = history_now()
  for i, id in ipairs(ids) do history_add(h, id, now_ms + (i - 1) / 1000, 'READY') end
  history_trim(h, now_ms, ttl_ms, max)
  history_expire(h, ttl_ms)
end

-- Move a task from the index of status `old` (nil: unknown, so from every other) to that of
-- `new`, keeping its score (the status indexes' time to live is refreshed by the consumers'
-- schedulers and each enqueue, not here: this runs for every result write);
-- a task the index lacks (one with a waiting mark, or an outside producer's) is added with the
-- score `fallback_score()`, its enqueue time: or now, when that is unknown (nil) or 0 (protobuf's
-- "not set"; at the epoch the next trim would drop it at once), and the index is trimmed to its
-- cap h.max and age h.max_age_ms by history_trim_entered (tasks enter the index here, not at enqueue).
-- A task added here with a known `old` is in no other status index: entries leave them with
-- `history` (history_drop), so nothing is removed. `first`: the record had no status yet, so the
-- index most likely lacks the task: the add is tried first, without a ZSCORE that finds nothing.
local function history_move(h, id, old, new, fallback_score, ttl_ms, first)
  local score = nil
  if not first then score = redis.pcall('ZSCORE', h.all, id) end
  if type(score) ~= 'string' then
    local entering = fallback_score()
    if not entering or entering <= 0 then entering = server_now_ms() end
    if history_add(h, id, entering, new) then
      h.entered = true
      -- The keys' time to live is renewed once a call (history_trim_entered), to the longest asked:
      -- never shortened, so a type with a short time to live keeps the others' entries.
      h.expire_ms = math.max(h.expire_ms or 0, ttl_ms)
      if old ~= nil then return end
    elseif first then
      score = redis.pcall('ZSCORE', h.all, id)  -- filed already (a unique task, a periodic run)
    end
  end
  if type(score) == 'string' and h.status[new] then
    redis.pcall('ZADD', h.status[new], score, id)
  end
  if old == nil then
    for name, key in pairs(h.status) do
      if name ~= new then redis.pcall('ZREM', key, id) end
    end
  elseif old ~= new and h.status[old] then
    redis.pcall('ZREM', h.status[old], id)
  end
end
