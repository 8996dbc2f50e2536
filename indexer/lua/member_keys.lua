-- The keys one member holds (in a tier, or any with '') from one chunk of its reverse
-- record, packed. ARGV: member, tier, offset, limit. Returns {packed keys, next or -1}.
if not nbuckets then return {'', -1} end
local mid = member_id(ARGV[1])
if not mid then return {'', -1} end
local which, offset, limit = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local chunk = call('GETRANGE', BASE .. 'log:' .. mid, offset * 8, (offset + limit) * 8 - 1)
local at, mask = math.floor(mid / 8) + 1, bit.lshift(1, mid % 8)
local all = multi_tier()
local out = {}
for i = 1, #chunk, 8 do
  local k = ssub(chunk, i, i + 7)
  local v0, v1, v2 = values(bucket(k), k, all)
  local held
  if which == '' then
    held = has_bit(v0, at, mask) or has_bit(v1, at, mask) or has_bit(v2, at, mask)
  else
    held = has_bit(({[0] = v0, v1, v2})[tonumber(which)], at, mask)
  end
  if held then out[#out + 1] = k end
end
return {table.concat(out), #chunk < limit * 8 and -1 or offset + limit}
