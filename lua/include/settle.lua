-- Settling a claimed task (ack, retry_later, dead_letter): take it out of this consumer's
-- processing list, KEYS[1], and clear its marks in the recoveries hash: the start mark
-- ("s:<sha1>") and, unless keep_count, its recovery count ("<sha1>"). Returns 1, or 0 when the
-- list does not hold the task (reaped or finished elsewhere), having written nothing.
-- `recoveries` false: the caller found no recoveries hash, so there is no mark to clear.
-- The task is found by its bytes. A twin of the same bytes in this list is the same task pushed
-- twice, each copy a claim of its own: removing either copy leaves one for the other claim. The
-- marks are the bytes' too, so settling one twin clears them for both: a twin running as a
-- suspect that then kills its consumer counts as a first recovery again (its dead-lettering
-- comes later; nothing is lost or run twice by it). A run of a process frozen past its lease
-- whose fixed id a restart registered since would find the restart's claim of the same task
-- here: the scripts first check that no other instance registered the id (other_instance,
-- include/instance.lua) and settle nothing if one did.
local function settle_claimed(task, recoveries, keep_count)
  if redis.call('LREM', KEYS[1], -1, task) == 0 then return 0 end
  if not recoveries then return 1 end
  local digest = redis.sha1hex(task)
  if keep_count then
    redis.call('HDEL', recoveries, 's:' .. digest)
  else
    redis.call('HDEL', recoveries, digest, 's:' .. digest)
  end
  return 1
end

