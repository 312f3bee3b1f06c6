-- This node's uptime (ms) and replication id, from one INFO call, for the restart and failover
-- guards (heartbeat, reap, renew_slots).
local function node_state()
  local info = redis.call('INFO', 'server', 'replication')
  local uptime_s = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
  return (uptime_s or 1e9) * 1000, string.match(info, 'master_replid:(%w+)') or ''  -- unknown uptime: long enough
end
