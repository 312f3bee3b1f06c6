-- Protobuf encoding: a length-delimited field (string or bytes) with a one-byte tag (numbers 1-15).
-- Appending one to a serialized message sets that field (for a scalar field the last value wins).
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
