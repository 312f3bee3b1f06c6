-- announce_queues: add queue names to the queue set, what the dashboard finds queues by. A set of
-- another type (a foreign writer's) is left alone: it only lists queues, so no enqueue, pause or
-- registration beside it fails for it.
-- KEYS[1] the queue set
-- ARGV[1..] queue names
-- Returns: how many names were new; or, with nothing written, the text of the WRONGTYPE error
-- naming the key (a reply, not an error: the calls beside it in a pipeline or MULTI go on).
-- include: key_types
local refused = wrong_key_type({'set'})
if refused then return refused.err end
local added = 0
-- unpack is limited to a few thousand values: add in chunks.
for from = 1, #ARGV, 1000 do
  added = added + redis.call('SADD', KEYS[1], unpack(ARGV, from, math.min(#ARGV, from + 999)))
end
return added
