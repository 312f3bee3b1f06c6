-- The error to return, before any write, if one of KEYS holds another type than expected (a
-- foreign writer's mistake): Lua is not rolled back, so an error halfway through a script that
-- already removed a task from a processing list would lose the task. nil if all are fine.
local function wrong_key_type(expected)
  for i, want in ipairs(expected) do
    local kind = KEYS[i] and redis.call('TYPE', KEYS[i]).ok
    if kind and kind ~= 'none' and kind ~= want then
      return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' holds a ' .. kind .. ', not a ' .. want)
    end
  end
  return nil
end
