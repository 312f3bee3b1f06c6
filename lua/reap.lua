-- reap: return the tasks of a consumer whose lease expired to the head of the suspects list.
-- KEYS[1] consumers zset   KEYS[2] consumer info hash   KEYS[3] reaped zset (tombstones)
-- KEYS[4] processing list of the dead consumer   KEYS[5] pending list   KEYS[6] dead zset
-- KEYS[7] recoveries hash (sha1 of task -> times recovered; "s:" .. sha1 -> started as a suspect)
-- KEYS[8] suspects list   KEYS[9] primary marker hash (replid, since_ms: see heartbeat)
-- KEYS[10] staging list of the dead consumer (a task a blocking claim moved there, its script
-- behind it not run: see claim_staged.lua); its tasks join the processing list first
-- ARGV[1] consumer id   ARGV[2] max recoveries before dead-lettering   ARGV[3] max tasks moved
-- ARGV[4] wake token (dropped)   ARGV[5] default lease ms (when the consumer left no info, or
-- none that is a lease: see lease_of)
-- ARGV[6] "1" when a consumer registering under this id recovers what its own earlier run left:
-- that run is dead whatever its lease says; no tombstone (the id is about to be live again)
-- Returns: {status, requeued, still in the list, dead-lettered tasks...}; status 1 reaped,
-- -1 lease still alive (nothing touched), -2 Redis restarted, or this node became the slot's
-- primary, less than a lease ago (live consumers have not had the chance to renew yet),
-- -3 not a consumer this queue knows. The destinations' types are checked before the first
-- write, so a key of the wrong type moves nothing.
-- include: args
local now_ms = server_now_ms()

-- The consumer's own lease length (ms), or the default when it left no info.
local function lease_of(id)
  local info = redis.call('HGET', KEYS[2], id)
  return info and stored_int(cjson.decode(info)['lease_ms']) or int_arg(ARGV[5], 0, 0, 2 ^ 53)
end

-- include: node
-- True while live consumers may not have renewed yet: Redis restarted, or this node took
-- the slot over (its replication id is not the one heartbeats last marked), under a lease ago.
local function holding(lease_ms)
  local uptime_ms, replid = node_state()
  if uptime_ms < lease_ms then return true end
  local marked = redis.call('HMGET', KEYS[9], 'replid', 'since_ms')
  local since_ms = tonumber(marked[2])
  return marked[1] ~= replid or not since_ms or now_ms - since_ms < lease_ms
end

redis.call('ZCARD', KEYS[3]); redis.call('LLEN', KEYS[4]); redis.call('LLEN', KEYS[5])
redis.call('ZCARD', KEYS[6]); redis.call('HLEN', KEYS[7]); redis.call('LLEN', KEYS[8]); redis.call('LLEN', KEYS[10])
local deadline = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
if ARGV[6] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
elseif deadline then
  if deadline > now_ms then
    return {-1, 0, 0}
  end
  if holding(lease_of(ARGV[1])) then
    return {-2, 0, 0}
  end
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], now_ms, ARGV[1])
elseif not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  return {-3, 0, 0}
end

-- include: protobuf
local function with_string_field(message, number, value)
  return message .. string_field(number, value)
end

while redis.call('RPOPLPUSH', KEYS[10], KEYS[4]) do end
local result = {1, 0, 0}
local max_recoveries = tonumber(ARGV[2])
for _ = 1, tonumber(ARGV[3]) do
  -- Newest first onto the head of suspects, so the oldest claimed runs first.
  local task = redis.call('LPOP', KEYS[4])
  if not task then break end
  if task ~= ARGV[4] then
    -- A first recovery always counts (nobody knows which of the dead consumer's tasks ran);
    -- after that a task is a suspect and counts only if it was running as one (marked when it
    -- started), so tasks merely claimed or running beside a poison pill are not blamed for it.
    local digest = redis.sha1hex(task)
    local recovered = tonumber(redis.call('HGET', KEYS[7], digest)) or 0
    if recovered == 0 or redis.call('HEXISTS', KEYS[7], 's:' .. digest) == 1 then
      recovered = recovered + 1
    end
    redis.call('HDEL', KEYS[7], 's:' .. digest)
    if recovered > max_recoveries then
      redis.call('HDEL', KEYS[7], digest)
      local reason = 'recovered ' .. recovered .. ' times from consumers that died running it'
      local dead = with_string_field(with_string_field(task, 11, 'ConsumerDied: ' .. reason), 13, reason)
      redis.call('ZADD', KEYS[6], now_ms, dead)
      result[#result + 1] = dead
    else
      redis.call('HSET', KEYS[7], digest, recovered)
      redis.call('RPUSH', KEYS[8], task)
      result[2] = result[2] + 1
    end
  end
end
-- Consumers blocked on pending claim suspects too once woken.
if result[2] > 0 and redis.call('LLEN', KEYS[5]) == 0 then
  redis.call('LPUSH', KEYS[5], ARGV[4])
end
result[3] = redis.call('LLEN', KEYS[4])
return result
