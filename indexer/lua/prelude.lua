-- Shared by every index script: key names, bitmaps, counters, member ids.
-- KEYS: the model's meta, stats, ids, names, free and copies keys (KeySpace's
-- ModelKeys.script_keys, indexer/redis_keys.py). The bucket ('b:<n>') and reverse-record
-- ('log:<id>') keys share their base and hash tag; which ones a call touches is known
-- only here, so they are derived from the base.
local META, STATS, IDS, NAMES, FREE, COPIES = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local BASE = string.sub(META, 1, -5)
local SUFFIX = {[0] = '', [1] = '\1', [2] = '\2'}
local band, bor, bnot = bit.band, bit.bor, bit.bnot
local sbyte, schar, ssub = string.byte, string.char, string.sub
local call = redis.call

local nbuckets = tonumber(call('HGET', META, 'buckets'))
local bucket_names = {}
local function bucket(k)
  local a, b = sbyte(k, 7, 8)
  local n = (a * 256 + b) % nbuckets
  local name = bucket_names[n]
  if not name then
    name = BASE .. 'b:' .. n
    bucket_names[n] = name
  end
  return name
end

local function has_bit(v, at, mask)
  if not v then return false end
  local b = sbyte(v, at)
  return b ~= nil and band(b, mask) ~= 0
end

local stat, dirty = {}, {}
-- v with bit `mask` of byte `at` cleared, trailing zero bytes dropped ('' when none left)
local function without_bit(v, at, mask)
  local b = band(sbyte(v, at), bnot(mask))
  if at == #v and b == 0 then
    local j = at - 1
    while j > 0 and sbyte(v, j) == 0 do j = j - 1 end
    return ssub(v, 1, j)
  end
  return ssub(v, 1, at - 1) .. schar(b) .. ssub(v, at + 1)
end

local function get_stat(f)
  local v = stat[f]
  if v == nil then
    v = tonumber(call('HGET', STATS, f)) or 0
    stat[f] = v
  end
  return v
end
local function add_stat(f, d)
  stat[f] = get_stat(f) + d
  dirty[f] = true
end
local function flush_stats()
  local set, del = {}, {}
  for f in pairs(dirty) do
    if stat[f] ~= 0 then
      set[#set + 1] = f
      set[#set + 1] = stat[f]
    else
      del[#del + 1] = f
    end
    if #set >= 400 then call('HSET', STATS, unpack(set)); set = {} end
    if #del >= 400 then call('HDEL', STATS, unpack(del)); del = {} end
  end
  if #set > 0 then call('HSET', STATS, unpack(set)) end
  if #del > 0 then call('HDEL', STATS, unpack(del)) end
  dirty = {}
end
local function multi_tier()
  return get_stat('t1') + get_stat('t2') > 0
end

-- A bitmap (bit = member id) of the members named in ARGV[2..], for a query restricted
-- to them; false when none of them holds an id (so none holds anything).
local function named_members()
  local names = {}
  for i = 2, #ARGV do names[#names + 1] = ARGV[i] end
  local bytes, top = {}, 0
  for _, mid in ipairs(call('HMGET', IDS, unpack(names))) do
    if mid then
      mid = tonumber(mid)
      local at = math.floor(mid / 8) + 1
      for j = top + 1, at do bytes[j] = 0 end
      if at > top then top = at end
      bytes[at] = bor(bytes[at], bit.lshift(1, mid % 8))
    end
  end
  if top == 0 then return false end
  return schar(unpack(bytes, 1, top))
end

-- The bits two bitmaps share, trailing zero bytes trimmed; '' when none. Bitmap strings
-- are short (8 bytes for 64 members): each is read with one string.byte.
local function and_str(a, b)
  local n = math.min(#a, #b)
  local x, y = {sbyte(a, 1, n)}, {sbyte(b, 1, n)}
  local last = 0
  for j = 1, n do
    local v = band(x[j], y[j])
    x[j] = v
    if v ~= 0 then last = j end
  end
  if last == 0 then return '' end
  return schar(unpack(x, 1, last))
end

-- Extra copies (past the first) of one (key, tier, member) entry live in COPIES, field
-- key .. tier byte .. member id; stats 'c' counts the fields, so a model without any
-- (the usual case) never reads the hash.
local function copy_field(k, tier, mid)
  return k .. schar(tier) .. mid
end
local function drop_copies(k, tier, mid)
  if get_stat('c') > 0 and call('HDEL', COPIES, copy_field(k, tier, mid)) == 1 then
    add_stat('c', -1)
  end
end

local ids = {}
local function member_id(name)
  local mid = ids[name]
  if mid == nil then
    mid = call('HGET', IDS, name)
    if mid then mid = tonumber(mid) end
    ids[name] = mid
  end
  return mid
end

local function release(mid)
  local name = call('HGET', NAMES, mid)
  if name then
    call('HDEL', IDS, name)
    ids[name] = false
  end
  call('HDEL', NAMES, mid)
  call('ZADD', FREE, mid, mid)
  call('DEL', BASE .. 'log:' .. mid, BASE .. 'log:' .. mid .. ':tmp')
  for _, f in ipairs({'e0:', 'e1:', 'e2:', 'h:'}) do
    stat[f .. mid] = 0
    dirty[f .. mid] = true
  end
end

-- The three tier values of key k in its bucket (only GPU's when no other tier is used).
local function values(bkey, k, all)
  if all then
    local v = call('HMGET', bkey, k, k .. '\1', k .. '\2')
    return v[1], v[2], v[3]
  end
  return call('HGET', bkey, k), false, false
end
