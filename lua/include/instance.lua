-- Whether consumer `id`'s registered info (JSON in hash `info_key`) names an instance other than
-- `token` (a token of "" or no instance registered: no). Whatever a foreign process wrote there,
-- never an error.
local function other_instance(info_key, id, token)
  if not token or token == '' then return false end
  local ok, info = pcall(cjson.decode, redis.call('HGET', info_key, id) or '')
  local registered = ok and type(info) == 'table' and info['instance']
  return type(registered) == 'string' and registered ~= token
end
