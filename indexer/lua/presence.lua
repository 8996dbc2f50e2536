-- Which members hold each of the given keys, per tier (no early stop: sliding-window
-- and Mamba hits need blocks past a hole). ARGV: packed keys, then optional member
-- names to restrict to. Returns a Redis array (bitmaps are binary, so not msgpack
-- strings): {id, name, ...} of the members that occur, then {position, gpu bitmap,
-- cpu bitmap, storage bitmap, ...} ('' for none) for every position someone holds.
if not nbuckets then return {{}, {}} end
local keys = ARGV[1]
local allowed = nil
-- v's bits of the allowed members; v when v is absent, false when none is left.
local function only_allowed(v)
  if not v then return v end
  local x = and_str(v, allowed)
  return x ~= '' and x
end
if #ARGV > 1 then
  allowed = named_members()
  if not allowed then return {{}, {}} end
end
local all = multi_tier()
local n = #keys / 8
local by_bucket, order = {}, {}
for j = 0, n - 1 do
  local k = ssub(keys, j * 8 + 1, j * 8 + 8)
  local name = bucket(k)
  local b = by_bucket[name]
  if not b then
    b = {fields = {}, at = {}}
    by_bucket[name] = b
    order[#order + 1] = name
  end
  b.at[#b.at + 1] = j
  if all then
    local f = b.fields
    f[#f + 1], f[#f + 2], f[#f + 3] = k, k .. '\1', k .. '\2'
  else
    b.fields[#b.fields + 1] = k
  end
end
local blocks, seen = {}, {}
local function note(v)
  if not v then return '' end
  local bytes = {sbyte(v, 1, -1)}
  for j = 1, #bytes do
    local byte = bytes[j]
    if byte ~= 0 then
      for b = 0, 7 do
        if band(byte, bit.lshift(1, b)) ~= 0 then seen[(j - 1) * 8 + b] = true end
      end
    end
  end
  return v
end
for _, name in ipairs(order) do
  local b = by_bucket[name]
  local v = call('HMGET', name, unpack(b.fields))
  for x, j in ipairs(b.at) do
    local v0, v1, v2
    if all then
      v0, v1, v2 = v[3 * x - 2], v[3 * x - 1], v[3 * x]
    else
      v0, v1, v2 = v[x], false, false
    end
    if allowed then
      v0, v1, v2 = only_allowed(v0), only_allowed(v1), only_allowed(v2)
    end
    if v0 or v1 or v2 then
      blocks[#blocks + 1] = j
      blocks[#blocks + 1] = note(v0)
      blocks[#blocks + 1] = note(v1)
      blocks[#blocks + 1] = note(v2)
    end
  end
end
local ids = {}
for mid in pairs(seen) do ids[#ids + 1] = mid end
local members = {}
if #ids > 0 then
  local names = call('HMGET', NAMES, unpack(ids))
  for x, mid in ipairs(ids) do
    if names[x] then
      members[#members + 1] = mid
      members[#members + 1] = names[x]
    end
  end
end
return {members, blocks}
