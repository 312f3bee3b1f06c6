-- Priorities: -100..100, higher first; the score of a prioritized task and the delayed-member prefix.
local function clamp_priority(priority)
  return math.max(-100, math.min(100, priority))
end
-- Score in the prioritized zset: (100 - priority) * 2^42 + server ms, so higher priority comes
-- first, then first come first served. The scores of one priority lie in [band, band + 2^42).
local PRIORITY_BAND = 4398046511104
local function priority_score(priority, now_ms)
  return (100 - clamp_priority(priority)) * PRIORITY_BAND + now_ms
end
-- Split a delayed-set member "<priority as %+04d><task>": priority, task; or nil and the reason
-- when the member is not one (no sign and 3 digits, a priority outside -100..100, no task).
local function split_delayed_member(member)
  local sign, digits = string.match(member, '^([+-])(%d%d%d)')
  if not sign then
    return nil, 'delayed member does not start with a priority (+000 to +100 or -001 to -100)'
  end
  local priority = tonumber(digits)
  if priority > 100 then
    return nil, 'delayed member has a priority outside -100..100: ' .. sign .. digits
  end
  if #member == 4 then
    return nil, 'delayed member has no task after its priority'
  end
  return sign == '-' and -priority or priority, string.sub(member, 5)
end
