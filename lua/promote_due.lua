-- promote_due: move delayed tasks whose time has come to pending (or prioritized), in a batch.
-- KEYS[1] delayed zset   KEYS[2] pending list   KEYS[3] prioritized zset   KEYS[4] recoveries
-- hash   KEYS[5] suspects list (where a due task that was recovered before goes back)
-- KEYS[6] dead zset (where a malformed member goes)
-- ARGV[1] max tasks to move   ARGV[2] wake token   ARGV[3] queue name   ARGV[4] type name of the
-- envelope that wraps a malformed member in the dead letters
-- Delayed members are "<priority as %+04d, -100..+100><serialized task>", scored by due time in
-- ms. A due member that is not one is dead-lettered (wrapped in a task envelope of type ARGV[4]
-- with the member as its payload and the reason), so it cannot hold up the others.
-- Returns: {moved, next due ms or -1, server now ms, malformed members dead-lettered}

-- include: args
-- include: priority
-- include: protobuf
local now_ms = server_now_ms()
local due = redis.call('ZRANGE', KEYS[1], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, int_arg(ARGV[1], 1000, 0, 100000))
local woke = false
local malformed = 0
local any_suspect = redis.call('HLEN', KEYS[4]) > 0

local function dead_letter(member, reason)
  local wrapper = string_field(1, 'malformed-' .. redis.sha1hex(member)) .. string_field(2, ARGV[4])
    .. string_field(3, member) .. string_field(4, ARGV[3])
    .. string_field(11, 'MalformedDelayedMember: ' .. reason) .. string_field(13, reason)
  redis.call('ZADD', KEYS[6], now_ms, wrapper)
  malformed = malformed + 1
end

for _, member in ipairs(due) do
  local priority, task = split_delayed_member(member)
  if not priority then
    dead_letter(member, task)
  elseif any_suspect and redis.call('HEXISTS', KEYS[4], redis.sha1hex(task)) == 1 then
    redis.call('LPUSH', KEYS[5], task)
    woke = true
  elseif priority == 0 then
    redis.call('LPUSH', KEYS[2], task)
  else
    redis.call('ZADD', KEYS[3], priority_score(priority, now_ms), task)
    woke = true
  end
  redis.call('ZREM', KEYS[1], member)
end
if woke and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('LPUSH', KEYS[2], ARGV[2])
end
-- A producer's score may be +inf: keep the reply an integer Redis can send (2^53 - 1 at most).
local next_due = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local next_due_ms = next_due[2] and math.min(tonumber(next_due[2]), 9007199254740991) or -1
return {#due - malformed, next_due_ms, now_ms, malformed}
