-- Whether consumer `id`'s registered info (JSON in hash `info_key`) names an instance other than
-- `token` (a token of "" or no instance registered: no).
local function other_instance(info_key, id, token)
  if not token or token == '' then return false end
  local info = redis.call('HGET', info_key, id)
  local registered = info and cjson.decode(info)['instance']
  return type(registered) == 'string' and registered ~= token
end
