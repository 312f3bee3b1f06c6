-- Protobuf: encoding a length-delimited field (string or bytes) with a one-byte tag (numbers
-- 1-15), whose appending to a serialized message sets that field (for a scalar field the last
-- value wins); reading an int32 or a string field of a serialized message.
local function varint(n)
  local out = ''
  while n >= 128 do
    out = out .. string.char(n % 128 + 128)
    n = math.floor(n / 128)
  end
  return out .. string.char(n)
end
local function string_field(number, value)
  return string.char(number * 8 + 2) .. varint(#value) .. value
end

-- The varint at byte `at` of `s`: its low 35 bits (exact in a Lua number), whether any bit above
-- them is set, and the position after it; nil if it runs past the end or beyond 10 bytes.
local function read_varint(s, at)
  local low, scale, high = 0, 1, false
  for i = at, math.min(at + 9, #s) do
    local byte = string.byte(s, i)
    if i - at < 5 then
      low = low + (byte % 128) * scale
      scale = scale * 128
    elseif byte % 128 > 0 then
      high = true
    end
    if byte < 128 then return low, high, i + 1 end
  end
  return nil
end

-- The last occurrence of field `number` of message `s` with wire type `want` (0 varint, 2
-- length-delimited): a varint's value as a Lua number (its low 35 bits; 0 if absent) or a
-- string's bytes ("" if absent). Nil when `s` is not a protobuf message: a field cut short, a
-- varint over 10 bytes, wire type 6 or 7, field number 0 or over 2^29 - 1, unbalanced groups.
-- An occurrence of another wire type is an unknown field, as protobuf's own parsers take it.
local function last_field(s, number, want)
  local value, at, groups = want == 2 and '' or 0, 1, {}
  while at <= #s do
    local tag, high, after = read_varint(s, at)
    if not tag or high or tag < 8 or tag >= 2 ^ 32 then return nil end
    local field, wire = math.floor(tag / 8), tag % 8
    local n, too_big = 0, false
    at = after
    if wire == 0 or wire == 2 then
      n, too_big, at = read_varint(s, after)
      if not n or (wire == 2 and too_big) then return nil end
    end
    if wire == want and field == number then
      value = wire == 0 and n or string.sub(s, at, at + n - 1)
    end
    if wire == 2 then
      at = at + n
    elseif wire == 1 or wire == 5 then
      at = at + (wire == 1 and 8 or 4)
    elseif wire == 3 then
      groups[#groups + 1] = field
    elseif wire == 4 and groups[#groups] == field then
      groups[#groups] = nil
    elseif wire ~= 0 then
      return nil
    end
    if at > #s + 1 then return nil end
  end
  if #groups > 0 then return nil end
  return value
end

-- The value of varint field `number` of message `s` as an int32 (the last occurrence, its low 32
-- bits, signed; 0 if absent), or nil when `s` is not a protobuf message (see last_field).
local function int32_field(s, number)
  local n = last_field(s, number, 0)
  if not n then return nil end
  n = n % 2 ^ 32
  return n >= 2 ^ 31 and n - 2 ^ 32 or n
end
