-- Stores, removes and announces of one model, in order.
-- KEYS: the six fixed keys, then each member's reverse record and its rewrite key
-- (ModelKeys.log, log_tmp), then the buckets the block keys fall in.
-- ARGV: the bucket count the client assumed, then per change six values: op ('s' store:
-- one more copy, 'r' remove: one copy fewer, 'a' announce: at least one copy), member,
-- the KEYS position of its reverse record (its rewrite key follows it), tier ('0'..'2'),
-- packed keys (8 bytes each, big-endian), and per key the KEYS position of its bucket
-- (two bytes each).
-- Returns {0, members whose reverse record needs compaction...} (the client rewrites
-- them with clear.lua), or {1, buckets} without writing anything when the model's
-- bucket count is not the one assumed.
if not nbuckets then
  nbuckets = tonumber(ARGV[1])
  -- A model written anew (first write, or again after Redis lost the index) starts its
  -- epoch at the server's clock in microseconds, so no reader can take the member names
  -- it cached of the lost model for the new one's.
  local now = call('TIME')
  local epoch = now[1] .. string.format('%06d', tonumber(now[2]))
  call('HSET', META, 'buckets', nbuckets, 'layout', LAYOUT, 'epoch', epoch)
elseif nbuckets ~= tonumber(ARGV[1]) then
  return {1, nbuckets}
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
  call('HINCRBY', META, 'epoch', 1)
  ids[name] = mid
  return mid
end

for c = 2, #ARGV, 6 do
  local op, name = ARGV[c], ARGV[c + 1]
  local store = op ~= 'r'  -- 's' adds a copy, 'a' holds at least one, 'r' drops one
  local mid
  if store then mid = intern(name) else mid = member_id(name) end
  if mid then
    local logat = tonumber(ARGV[c + 2])
    touched[mid] = {name, KEYS[logat], KEYS[logat + 1]}
    local tier = tonumber(ARGV[c + 3])
    local packed, positions = ARGV[c + 4], ARGV[c + 5]
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
      local bkey = bucket_at(positions, (i + 7) / 8)
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
            local left = clear_bit(bkey, f, v, at, mask)
            d_entries = d_entries - 1
            if not elsewhere then d_held = d_held - 1 end
            if not left and not others then d_keys = d_keys - 1 end
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

local out = {0}
for mid, log in pairs(appended) do
  if #log > 0 then
    local len = call('APPEND', touched[mid][2], table.concat(log))
    local held = get_stat('h:' .. mid)
    if held > 0 and len / 8 > 2 * held + 64 then out[#out + 1] = touched[mid][1] end
  end
end
for mid, member in pairs(touched) do
  if get_stat('h:' .. mid) == 0 then release(mid, member[1], member[2], member[3]) end
end
flush_stats()
return out
