-- claim_staged (one server only): finish a blocking claim in the round trip of its move. A
-- consumer sends it right behind `BLMOVE pending staging` on the same connection, so Redis runs
-- it as soon as the move returns: it moves the staged task on into the processing list, issues
-- its fencing token, writes its claim's receipt and drops its waiting mark.
-- KEYS[1] staging list of this consumer   KEYS[2] processing list of this consumer
-- KEYS[3] fence counter of the queue   KEYS[4] paused marker of the queue (read only)
-- ARGV[1] key prefix   ARGV[2] time to live of a record (s)   ARGV[3] wake token (dropped)
-- ARGV[4] the queue
-- The record and the mark are named from the envelope's id (field 1), so they are not in KEYS:
-- they lie in other slots, and Redis Cluster claims with BLMOVE into processing, issue_fence and
-- claim_receipts instead. The receipt is claim_receipts' (include/receipt.lua); the mark goes
-- after it, so a task always has a record or a mark. A task the move left staged (this script
-- failed, or never ran) is taken by the next call, or recovered by reap and deregister.
-- Returns: false when nothing is staged; {wake token, 0, 0, 0} for a wake token (dropped, never
-- moved on); else {task, fence, receipt, open}: the receipt as claim_receipts answers it, or -2
-- when the envelope's id or type could not be read here (not a protobuf message, empty, or not
-- printable ASCII): nothing written to a record, the caller writes the receipt with
-- claim_receipts; open is 1 if the queue is not paused (the task is claimed either way).

-- include: args
-- include: fence
-- include: start_gate
-- include: receipt
-- include: protobuf
redis.call('LLEN', KEYS[2])  -- its type, checked before the pop
local task = redis.call('LPOP', KEYS[1])
if not task then return false end
if task == ARGV[3] then return {task, 0, 0, 0} end
redis.call('LPUSH', KEYS[2], task)
local fence = issue_fences(KEYS[3], 1)
local id, task_type = last_field(task, 1, 2), last_field(task, 2, 2)
local function readable(s) return s and s ~= '' and not string.find(s, '[^\032-\126]') end
local open = 1 - redis.call('EXISTS', KEYS[4])
if not (readable(id) and readable(task_type)) then return {task, fence, -2, open} end
local ttl_s = int_arg(ARGV[2], 604800, 1, 2 ^ 31)
local receipt = write_receipt(ARGV[1] .. ':result:' .. id, fence, ttl_s, ARGV[4], task_type)
-- The mark's bucket and field, as docs/PROTOCOL.md "Waiting marks" names them from sha1(id).
local digest = redis.sha1hex(id)
local field = string.gsub(string.sub(digest, 5, 20), '..', function(hex) return string.char(tonumber(hex, 16)) end)
redis.call('HDEL', ARGV[1] .. ':waiting:' .. string.sub(digest, 1, 4), field)
return {task, fence, receipt, open}
