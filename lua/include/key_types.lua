-- The error to return, before any write, if one of KEYS holds another type than expected (a
-- foreign writer's mistake): Lua is not rolled back, so an error halfway through a script that
-- already removed a task from a processing list would lose the task. nil if all are fine.
-- `expected` names the types of KEYS[first], KEYS[first + 1], ... (first: 1 if not given).
local function wrong_key_type(expected, first)
  first = first or 1
  for i, want in ipairs(expected) do
    local key = KEYS[first + i - 1]
    local kind = key and redis.call('TYPE', key).ok
    if kind and kind ~= 'none' and kind ~= want then
      return redis.error_reply('WRONGTYPE ' .. key .. ' holds a ' .. kind .. ', not a ' .. want)
    end
  end
  return nil
end
