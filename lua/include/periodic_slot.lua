-- A periodic schedule's state hash (KEYS[1]) against one slot: shared by fire_periodic and skip_periodic.
-- A number of ms read from the state (nil: not set).
local function state_ms(name)
  return stored_int(redis.call('HGET', KEYS[1], name))
end
-- The slot of ARGV[1] and the server's now (ms), the last slot handled (nil: none), the last one
-- fired (-1: none), and the reply when the slot is not to be handled: an error (not a number of ms),
-- 'early' (after the server's now) or 'done' (at or before the last one handled).
local function periodic_slot(script)
  local now_ms = server_now_ms()
  local slot_ms = int_arg(ARGV[1], -1, -1, 2 ^ 53)
  local last = state_ms('slot_ms')
  local fired = state_ms('fired_slot_ms') or -1
  if slot_ms < 0 then return slot_ms, now_ms, last, fired, redis.error_reply('ERR ' .. script .. ': the slot must be a number of ms') end
  if now_ms < slot_ms then return slot_ms, now_ms, last, fired, {'early', now_ms, last or -1, fired} end
  if last and slot_ms <= last then return slot_ms, now_ms, last, fired, {'done', now_ms, last, fired} end
  return slot_ms, now_ms, last, fired, nil
end
