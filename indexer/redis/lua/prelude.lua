-- Shared by every index script: the layout check, bitmaps, counters, member ids.
-- KEYS[1..6]: the model's meta, stats, ids, names, free and copies keys (KeySpace's
-- ModelKeys.script_keys, indexer/redis/keys.py). A script's other keys (buckets,
-- reverse records) follow in KEYS, and ARGV says which one each block key or member
-- uses: no key name is built here, so every key a script touches came in KEYS.
local META, STATS, IDS, NAMES, FREE, COPIES = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local LAYOUT = '2'  -- redis_keys.LAYOUT
local SUFFIX = {[0] = '', [1] = '\1', [2] = '\2'}
local band, bor, bnot = bit.band, bit.bor, bit.bnot
local sbyte, schar, ssub = string.byte, string.char, string.sub
local call = redis.call

local meta = call('HMGET', META, 'buckets', 'layout')
local nbuckets = tonumber(meta[1])
if nbuckets and meta[2] ~= LAYOUT then
  return redis.error_reply('KVLAYOUT ' .. (meta[2] or '1'))
end

-- The bucket key of the x-th block key of a change: ARGV gives, per block key, the
-- KEYS position of its bucket as two big-endian bytes (the client's bucket_numbers).
local function bucket_at(positions, x)
  local a, b = sbyte(positions, 2 * x - 1, 2 * x)
  return KEYS[a * 256 + b]
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

-- Drop one member's bit from field f of bucket bkey, whose value is v (held): deletes
-- the field when no bit is left. Returns the new value, false when deleted. The one
-- place a bit is cleared (a remove in apply, every tier of a clear).
local function clear_bit(bkey, f, v, at, mask)
  local nv = without_bit(v, at, mask)
  if nv == '' then
    call('HDEL', bkey, f)
    return false
  end
  call('HSET', bkey, f, nv)
  return nv
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

-- Free a member's id once it holds nothing: its names, counters and reverse record
-- (logkey, and tmpkey its rewrite) go; the epoch tells readers their names are stale.
local function release(mid, name, logkey, tmpkey)
  call('HDEL', IDS, name)
  ids[name] = false
  call('HDEL', NAMES, mid)
  call('ZADD', FREE, mid, mid)
  call('HINCRBY', META, 'epoch', 1)
  call('DEL', logkey, tmpkey)
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
