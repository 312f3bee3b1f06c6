-- claim_receipts: tell the records of freshly claimed tasks which claim holds them, before any
-- of them starts, learn which were cancelled (see cancel.lua), and remove their waiting marks.
-- KEYS[1] to KEYS[n] the result hashes of the tasks; then (one server) KEYS[n + 1] to KEYS[2n]
-- the waiting marks' bucket hash of each task
-- ARGV[1] time to live of the records (s)   ARGV[2] "1" if the bucket hashes follow in KEYS
-- then per task 4 arguments: the fencing token of its claim, its mark's field (with the bucket
-- hashes), its queue and its type ("" if unknown)
-- Per task (include/receipt.lua): a record whose fence is above the token belongs to a later
-- claim (nothing written); a cancelled task's receipt is refused (include/start_gate.lua: nothing
-- written, or the record made CANCELLED); else claimed_fence and fence are set to the token,
-- which the run's RUNNING write then carries (never refused). A missing record is created with
-- those two fields, and its queue and type (so a cancel can tell its consumer); the RUNNING
-- write then fills in the rest. The mark goes after that: a task always has a record or a mark.
-- Returns: one reply per task: 1 held by this claim, 3 held, its record created here, 0 a later
-- claim holds it, 2 refused (the task was cancelled: it must not run), -1 not a record (a key a
-- producer wrote as another type: nothing done).

-- include: args
-- include: start_gate
-- include: receipt
local ttl_s = int_arg(ARGV[1], 604800, 1, 2 ^ 31)
local n = ARGV[2] == '1' and #KEYS / 2 or #KEYS
local replies = {}
for i = 1, n do
  local at = 4 * i - 1
  replies[i] = write_receipt(KEYS[i], tonumber(ARGV[at]) or 0, ttl_s, ARGV[at + 2] or '', ARGV[at + 3] or '')
  if n < #KEYS then redis.call('HDEL', KEYS[n + i], ARGV[at + 1]) end
end
return replies
