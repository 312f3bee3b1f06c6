-- history_move: file a task under its new status in its queue's history index where the write of
-- its record cannot: on Redis Cluster (the record lies in another slot than the index, so
-- record_result cannot), and after cancel.lua cancelled a task outright (on any server).
-- KEYS[1] history zset   KEYS[2] history ids zset   KEYS[3...] the status indexes, one per
-- status named in ARGV[7...]
-- ARGV[1] task id   ARGV[2] its new status   ARGV[3] enqueue time (ms), the score if the index
-- lacks the task   ARGV[4] time to live of the index keys (ms; 0: the record was deleted, the
-- task leaves the index)   ARGV[5] the cap of the index and ARGV[6] the age (ms) of its entries
-- at most, to which it is trimmed as the task enters it (0: not trimmed)   ARGV[7...] the status
-- names.
-- Not fenced like the record's write: sent where the record's reply is not known yet (a RUNNING
-- write alone), a late write of a run that lost its claim can file the task under a stale status
-- until the next change; the browser shows the record's own status. Where the reply is known (an
-- ack's, retry's or dead letter's write, written first) only a write the record took is moved.
-- Returns: 1.

-- include: args
-- include: history
local h = history_keys(KEYS[1], KEYS[2], {unpack(ARGV, 7, #ARGV)}, 3)
history_trim_on_entry(h, int_arg(ARGV[5], 0, 0, 2 ^ 53), int_arg(ARGV[6], 0, 0, 2 ^ 53))
local function enqueued_ms() return int_arg(ARGV[3], 0, 0, 2 ^ 53) end
if ARGV[4] == '0' then  -- the record's write deleted it (its type keeps none): so goes its entry
  history_drop(h, {ARGV[1]})
  return 1
end
history_move(h, ARGV[1], nil, ARGV[2], enqueued_ms, int_arg(ARGV[4], 604800000, 1, 2 ^ 53))
history_trim_entered(h)
return 1
