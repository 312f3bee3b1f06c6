-- mark_started: record that a suspect task starts a run, only while its consumer still holds the
-- lease (by the reaper's own test), so a death during the run counts against the task and a run
-- that will not start (its lease lost meanwhile) is never blamed for one.
-- KEYS[1] consumers zset (id -> lease deadline ms)   KEYS[2] consumer info hash
-- KEYS[3] recoveries hash ("s:" .. sha1 of the task -> started as a suspect)
-- ARGV[1] consumer id   ARGV[2] the process's instance token ("": unchecked)
-- ARGV[3] sha1 of the serialized task (hex)
-- Returns: 1 marked; 0 nothing written: the lease lapsed (or was reaped), or another instance
-- registered the consumer id since.

-- include: args
-- include: instance
local deadline = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
if not deadline or deadline <= server_now_ms() or other_instance(KEYS[2], ARGV[1], ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[3], 's:' .. ARGV[3], 1)
return 1
