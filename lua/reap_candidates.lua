-- reap_candidates: consumers whose lease expired, and reaped ids kept as tombstones, a page at a time.
-- KEYS[1] consumers zset   KEYS[2] reaped zset (id -> time reaped, ms)
-- ARGV[1] max ids (page size)   ARGV[2] how long tombstones are kept (ms)
-- ARGV[3] offset of a further page of tombstones, newest first (0: none; a multiple of the page size)
-- Returns: {expired ids..., "", tombstone ids..., "", number of tombstones}: the tombstones are
-- the newest page (where late claims of a reaped consumer land) and the page at the offset.
-- include: args
local now_ms = server_now_ms()
local page = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms - tonumber(ARGV[2]))
local out = redis.call('ZRANGE', KEYS[1], '-inf', '(' .. now_ms, 'BYSCORE', 'LIMIT', 0, page)
out[#out + 1] = ''
local function add_page(offset)
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], offset, offset + page - 1, 'REV')) do
    out[#out + 1] = id
  end
end
add_page(0)
local offset = tonumber(ARGV[3]) or 0
if offset >= page then add_page(offset) end
out[#out + 1] = ''
out[#out + 1] = redis.call('ZCARD', KEYS[2])
return out
