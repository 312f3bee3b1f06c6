-- reap_candidates: consumers whose lease expired, and reaped ids kept as tombstones, a page at a time,
-- on one or more queues.
-- KEYS[1] consumers zset   KEYS[2] reaped zset (id -> time reaped, ms); then the same two keys of
-- each further queue. On a single server one call looks at every queue of a consumer; on Redis
-- Cluster each call holds one.
-- ARGV[1] max ids (page size)   ARGV[2] how long tombstones are kept (ms)   ARGV[3...] per queue,
-- the offset of a further page of tombstones, newest first (0: none; a multiple of the page size)
-- Returns: per queue {expired ids..., "", tombstone ids..., "", number of tombstones}: the
-- tombstones are the newest page (where late claims of a reaped consumer land) and the page at
-- the offset.
-- include: args
local now_ms = server_now_ms()
local page = tonumber(ARGV[1])

local function candidates(consumers, reaped, offset)
  local out = redis.call('ZRANGE', consumers, '-inf', '(' .. now_ms, 'BYSCORE', 'LIMIT', 0, page)
  out[#out + 1] = ''
  -- Tombstones are rare (a consumer reaped lately): without any, one ZCARD is all they cost.
  local tombstones = redis.call('ZCARD', reaped)
  if tombstones > 0 then
    redis.call('ZREMRANGEBYSCORE', reaped, '-inf', now_ms - tonumber(ARGV[2]))
    local function add_page(from)
      for _, id in ipairs(redis.call('ZRANGE', reaped, from, from + page - 1, 'REV')) do
        out[#out + 1] = id
      end
    end
    add_page(0)
    if offset >= page then add_page(offset) end
    tombstones = redis.call('ZCARD', reaped)
  end
  out[#out + 1] = ''
  out[#out + 1] = tombstones
  return out
end

local found = {}
for at = 1, #KEYS - 1, 2 do
  found[#found + 1] = candidates(KEYS[at], KEYS[at + 1], tonumber(ARGV[2 + (at + 1) / 2]) or 0)
end
return found
