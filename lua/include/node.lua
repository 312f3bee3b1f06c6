-- This node's uptime and replication id, for the restart and failover guards (heartbeat, reap).
local function node_uptime_ms()
  local uptime_s = tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)'))
  return (uptime_s or 1e9) * 1000  -- unknown: long enough
end
local function node_replid()
  return string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''
end
