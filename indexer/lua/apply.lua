-- ARGV: default bucket count, then per change: op ('s' store: one more copy, 'r' remove:
-- one copy fewer, 'a' announce: at least one copy), member, tier ('0'..'2'), packed
-- keys. Returns the members whose reverse record needs compaction (the client runs
-- CLEAR with no tier for them, in chunks).
if not nbuckets then
  nbuckets = tonumber(ARGV[1])
  call('HSET', META, 'buckets', nbuckets)
end

local appended = {}
local touched = {}

local function intern(name)
  local mid = member_id(name)
  if mid then return mid end
  local free = call('ZPOPMIN', FREE)
  if free[1] then
    mid = tonumber(free[1])
  else
    mid = call('HINCRBY', META, 'next_id', 1) - 1
  end
  call('HSET', IDS, name, mid)
  call('HSET', NAMES, mid, name)
  ids[name] = mid
  return mid
end

for c = 2, #ARGV, 4 do
  local op = ARGV[c]
  local store = op ~= 'r'  -- 's' adds a copy, 'a' holds at least one, 'r' drops one
  local mid
  if store then mid = intern(ARGV[c + 1]) else mid = member_id(ARGV[c + 1]) end
  if mid then
    touched[mid] = true
    local tier = tonumber(ARGV[c + 2])
    local packed = ARGV[c + 3]
    local at, mask = math.floor(mid / 8) + 1, bit.lshift(1, mid % 8)
    local suffix = SUFFIX[tier]
    -- A GPU change in a model without CPU or STORAGE entries reads GPU fields only (and
    -- cannot create other tiers' entries while it runs).
    local all = tier ~= 0 or multi_tier()
    local alone = string.rep('\0', at - 1) .. schar(mask)  -- the bitmap of this member only
    local d_entries, d_held, d_keys = 0, 0, 0
    local log = appended[mid]
    if store and not log then
      log = {}
      appended[mid] = log
    end
    for i = 1, #packed, 8 do
      local k = ssub(packed, i, i + 7)
      local bkey = bucket(k)
      if store and not all and call('HSETNX', bkey, k, alone) == 1 then
        -- A block nobody held, the common case at ingest: one call.
        d_entries, d_held, d_keys = d_entries + 1, d_held + 1, d_keys + 1
        log[#log + 1] = k
      else
        local v0, v1, v2 = values(bkey, k, all)
        local v = v0
        if tier == 1 then v = v1 elseif tier == 2 then v = v2 end
        local held = has_bit(v, at, mask)
        local flip = store ~= held
        if held and op == 's' then
          if call('HINCRBY', COPIES, copy_field(k, tier, mid), 1) == 1 then add_stat('c', 1) end
        elseif held and not store and get_stat('c') > 0 then
          local f = copy_field(k, tier, mid)
          local extra = tonumber(call('HGET', COPIES, f))
          if extra then
            flip = false  -- another copy is still held
            if extra <= 1 then
              call('HDEL', COPIES, f)
              add_stat('c', -1)
            else
              call('HINCRBY', COPIES, f, -1)
            end
          end
        end
        if flip then
          local elsewhere = (tier ~= 0 and has_bit(v0, at, mask))
            or (tier ~= 1 and has_bit(v1, at, mask))
            or (tier ~= 2 and has_bit(v2, at, mask))
          local others = (tier ~= 0 and v0) or (tier ~= 1 and v1) or (tier ~= 2 and v2)
          local f = k .. suffix
          if store then
            local nv
            if not v then
              nv = alone
            elseif #v < at then
              nv = v .. string.rep('\0', at - #v - 1) .. schar(mask)
            else
              nv = ssub(v, 1, at - 1) .. schar(bor(sbyte(v, at), mask)) .. ssub(v, at + 1)
            end
            call('HSET', bkey, f, nv)
            d_entries = d_entries + 1
            if not elsewhere then
              d_held = d_held + 1
              log[#log + 1] = k
            end
            if not v and not others then d_keys = d_keys + 1 end
          else
            local nv = without_bit(v, at, mask)
            if nv == '' then call('HDEL', bkey, f) else call('HSET', bkey, f, nv) end
            d_entries = d_entries - 1
            if not elsewhere then d_held = d_held - 1 end
            if nv == '' and not others then d_keys = d_keys - 1 end
          end
        end
      end
    end
    if d_entries ~= 0 then
      add_stat('t' .. tier, d_entries)
      add_stat('e' .. tier .. ':' .. mid, d_entries)
    end
    if d_held ~= 0 then add_stat('h:' .. mid, d_held) end
    if d_keys ~= 0 then add_stat('k', d_keys) end
  end
end

local grown, compact = {}, {}
for mid, log in pairs(appended) do
  if #log > 0 then
    local len = call('APPEND', BASE .. 'log:' .. mid, table.concat(log))
    if len / 8 > 2 * get_stat('h:' .. mid) + 64 then grown[#grown + 1] = mid end
  end
end
for mid in pairs(touched) do
  if get_stat('h:' .. mid) == 0 then release(mid) end
end
for _, mid in ipairs(grown) do
  local name = call('HGET', NAMES, mid)
  if name then compact[#compact + 1] = name end
end
flush_stats()
return compact
