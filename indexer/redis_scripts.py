"""The Lua scripts of the Redis backend, and how they are called.

Why server-side scripts: a store or remove must read a block's member bitmap, change one
bit and write it back, keep per-member counters exact and append to the member's
reverse record. Done from the client that is several round trips per block; as a script
it is one round trip per delivery chunk, and atomic. A lookup walks the prompt's chain
and stops at the first block no candidate holds, which a pipeline cannot do (it would
fetch all 512 blocks of an 8k-token prompt every time; ``bench/bench_redis.py`` measures
both).

Every index script gets one key, the model's ``meta`` key, and derives the model's
other keys from it: they share its hash tag, so in Redis Cluster they live in its slot
(see the README, "Shared index in Redis"). Layout, with ``B`` = ``<prefix>:{<model>}:``:

* ``B meta``   hash: ``buckets`` (fixed when the model is first written), ``next_id``.
* ``B b:<n>``  hash, one of ``buckets``: field = block key (8 bytes, big-endian) for
  GPU, key + ``\\1`` for CPU, key + ``\\2`` for STORAGE; value = bitmap of member ids
  (bit ``id % 8`` of byte ``id // 8``), trailing zero bytes trimmed, never empty. The
  bucket is the key's low 16 bits modulo ``buckets``.
* ``B ids`` / ``B names``  hashes: member → id and id → member; ids are per model,
  the smallest free one is reused (``B free``, a sorted set) so bitmaps stay short.
* ``B log:<id>``  string: the reverse record, 8-byte keys the member came to hold, in
  order; entries go stale when it drops a block and are compacted away.
* ``B copies``  hash: field = block key + tier byte + member id (decimal), value = the
  entry's copies past the first (vLLM holds one hash in several physical blocks and
  publishes a store and a removal per copy); only entries with two or more copies.
* ``B stats``  hash: ``k`` distinct keys held by anyone, ``t<tier>`` entries per tier,
  ``e<tier>:<id>`` a member's entries per tier, ``h:<id>`` distinct keys it holds,
  ``c`` fields of ``B copies``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

# Shared by every index script: key names, bitmaps, counters, member ids.
_PRELUDE = r"""
local META = KEYS[1]
local BASE = string.sub(META, 1, -5)
local STATS = BASE .. 'stats'
local IDS = BASE .. 'ids'
local NAMES = BASE .. 'names'
local FREE = BASE .. 'free'
local COPIES = BASE .. 'copies'
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
"""

# ARGV: default bucket count, then per change: op ('s' store: one more copy, 'r' remove:
# one copy fewer, 'a' announce: at least one copy), member, tier ('0'..'2'), packed
# keys. Returns the members whose reverse record needs compaction (the client runs
# CLEAR with no tier for them, in chunks).
APPLY = (
    _PRELUDE
    + r"""
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
            local b = band(sbyte(v, at), bnot(mask))
            local nv
            if at == #v and b == 0 then
              local j = at - 1
              while j > 0 and sbyte(v, j) == 0 do j = j - 1 end
              nv = ssub(v, 1, j)
            else
              nv = ssub(v, 1, at - 1) .. schar(b) .. ssub(v, at + 1)
            end
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
"""
)

# Drop what one member holds, or compact its reverse record, one chunk of the record at
# a time so a member with a million blocks never blocks Redis for long.
# ARGV: member, tiers ('a' all, '0'..'2' one, '' none = compaction only), offset (in
# entries), limit. Returns {entries dropped, next offset or -1 when done}.
# With a single tier or none, the keys still held are written to log:<id>:tmp, which
# replaces the record at the end.
CLEAR = (
    _PRELUDE
    + r"""
if not nbuckets then return {0, -1} end
local mid = member_id(ARGV[1])
if not mid then return {0, -1} end
local which, offset, limit = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local scope = {}
if which == 'a' then scope = {[0] = true, true, true}
elseif which ~= '' then scope[tonumber(which)] = true end
local logkey = BASE .. 'log:' .. mid
local tmpkey = logkey .. ':tmp'
local chunk = call('GETRANGE', logkey, offset * 8, (offset + limit) * 8 - 1)
local at, mask = math.floor(mid / 8) + 1, bit.lshift(1, mid % 8)
local all = multi_tier()
local seen, kept = {}, {}
local dropped = 0
for i = 1, #chunk, 8 do
  local k = ssub(chunk, i, i + 7)
  if not seen[k] then
    seen[k] = true
    local bkey = bucket(k)
    local v0, v1, v2 = values(bkey, k, all)
    local vals = {[0] = v0, v1, v2}
    local held_before, held_after, live_after = false, false, false
    for t = 0, 2 do
      local v = vals[t]
      if has_bit(v, at, mask) then
        held_before = true
        if scope[t] then
          local b = band(sbyte(v, at), bnot(mask))
          local nv
          if at == #v and b == 0 then
            local j = at - 1
            while j > 0 and sbyte(v, j) == 0 do j = j - 1 end
            nv = ssub(v, 1, j)
          else
            nv = ssub(v, 1, at - 1) .. schar(b) .. ssub(v, at + 1)
          end
          if nv == '' then
            call('HDEL', bkey, k .. SUFFIX[t])
          else
            call('HSET', bkey, k .. SUFFIX[t], nv)
          end
          add_stat('t' .. t, -1)
          add_stat('e' .. t .. ':' .. mid, -1)
          drop_copies(k, t, mid)
          dropped = dropped + 1
          v = nv ~= '' and nv or false
        else
          held_after = true
        end
      end
      if v then live_after = true end
    end
    if held_before and not held_after then add_stat('h:' .. mid, -1) end
    if held_before and not live_after then add_stat('k', -1) end
    if held_after then kept[#kept + 1] = k end
  end
end
local done = #chunk < limit * 8
if which ~= 'a' and #kept > 0 then call('APPEND', tmpkey, table.concat(kept)) end
if done then
  if which == 'a' then
    call('DEL', logkey, tmpkey)
  elseif call('EXISTS', tmpkey) == 1 then
    call('RENAME', tmpkey, logkey)
  else
    call('DEL', logkey)
  end
  if get_stat('h:' .. mid) <= 0 then release(mid) end
end
flush_stats()
return {dropped, done and -1 or offset + limit}
"""
)

# Longest held prefix of a chain, per member. ARGV: packed chain keys, then optionally
# the candidate members. Walks the chain in order, a chunk of blocks per read, and stops
# at the first block no remaining candidate holds. Consecutive blocks usually have
# identical bitmaps (the same pods stored the whole prefix), so most blocks cost a
# string comparison; bitmaps are intersected only where they change.
# Returns, msgpack-encoded, a flat array: member, matched blocks, GPU, CPU, STORAGE, ...
LOOKUP = (
    _PRELUDE
    + r"""
if not nbuckets then return cmsgpack.pack({}) end
local chain = ARGV[1]
local alive = nil

-- Bitmap strings are short (8 bytes for 64 members): read each with one string.byte.
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
local function andnot_str(a, b)  -- bits of a not in b
  local x, y = {sbyte(a, 1, -1)}, {sbyte(b, 1, -1)}
  for j = 1, #x do x[j] = band(x[j], bnot(y[j] or 0)) end
  return schar(unpack(x))
end
local function or3(a, b, c)
  local parts = {}
  if a then parts[#parts + 1] = a end
  if b then parts[#parts + 1] = b end
  if c then parts[#parts + 1] = c end
  if #parts == 0 then return false end
  if #parts == 1 then return parts[1] end
  local n = 0
  for _, p in ipairs(parts) do if #p > n then n = #p end end
  local out = {}
  for j = 1, n do
    local x = 0
    for _, p in ipairs(parts) do x = bor(x, sbyte(p, j) or 0) end
    out[j] = x
  end
  return schar(unpack(out))
end

if #ARGV > 1 then
  alive = named_members()
  if not alive then return cmsgpack.pack({}) end
end

local all = multi_tier()
local ends, runs = {}, {}
local prev, run_held = nil, false
local prev0, prev1, prev2 = nil, nil, nil
local n = #chain / 8

-- Read the bitmaps of blocks first..last-1 (0-based) into got[j + 1] (GPU only) or
-- got[3 * j + tier + 1].
-- Few buckets (the default): one HMGET per bucket the blocks fall in. Many small
-- buckets (listpack-encoded, for memory): one HGET per block, the walk reading one block
-- at a time so that it stops right at the first miss.
local sparse = nbuckets > 1024 and not all
local function read(first, last, got)
  if sparse then
    for j = first, last - 1 do
      local k = ssub(chain, j * 8 + 1, j * 8 + 8)
      got[j + 1] = call('HGET', bucket(k), k)
    end
    return
  end
  local fields_of, blocks_of, order = {}, {}, {}
  for j = first, last - 1 do
    local o = j * 8
    local k = ssub(chain, o + 1, o + 8)
    local x, y = sbyte(chain, o + 7, o + 8)
    local b = (x * 256 + y) % nbuckets
    local f = fields_of[b]
    if not f then
      f = {}
      fields_of[b] = f
      blocks_of[b] = {}
      order[#order + 1] = b
    end
    local p = blocks_of[b]
    p[#p + 1] = j
    if all then
      local nf = #f
      f[nf + 1], f[nf + 2], f[nf + 3] = k, k .. '\1', k .. '\2'
    else
      f[#f + 1] = k
    end
  end
  for _, b in ipairs(order) do
    local name = bucket_names[b]
    if not name then
      name = BASE .. 'b:' .. b
      bucket_names[b] = name
    end
    local v = call('HMGET', name, unpack(fields_of[b]))
    local p = blocks_of[b]
    if all then
      for x = 1, #p do
        local at = 3 * p[x]
        got[at + 1], got[at + 2], got[at + 3] = v[3 * x - 2], v[3 * x - 1], v[3 * x]
      end
    else
      for x = 1, #p do got[p[x] + 1] = v[x] end
    end
  end
end

-- Walk the chain in chunks of 32, 128, then 512 blocks: a prompt that matches only a
-- short prefix (a shared system prompt, then nothing) costs one small chunk, a long
-- match a few calls per bucket. A call costs far more than a field it reads.
local got = {}
local i, first, step = 0, 0, sparse and 1 or 32
local stop = false
while first < n and not stop do
  local last = math.min(n, first + step)
  read(first, last, got)
  for j = first, last - 1 do
    local held
    if all then
      local v0, v1, v2 = got[3 * j + 1], got[3 * j + 2], got[3 * j + 3]
      if v0 ~= prev0 or v1 ~= prev1 or v2 ~= prev2 then
        run_held = or3(v0, v1, v2)
        runs[#runs + 1] = {j, v0, v1, v2}
        prev0, prev1, prev2 = v0, v1, v2
      end
      held = run_held
    else
      held = got[j + 1]
    end
    if not held then
      stop = true
      break
    end
    if held ~= prev then
      local now = alive and and_str(alive, held) or held
      if now == '' then
        stop = true
        break
      end
      if alive and now ~= alive and j > 0 then ends[#ends + 1] = {j, andnot_str(alive, now)} end
      alive = now
      prev = held
    end
    i = j + 1
  end
  first = last
  if step < 512 and not sparse then step = step * 4 end
end
if i > 0 and alive then ends[#ends + 1] = {i, alive} end

local out = {}
local want, lens = {}, {}
local positions = {}  -- byte value -> its set bits, built for the values that occur
for _, e in ipairs(ends) do
  local len = e[1]
  local bytes = {sbyte(e[2], 1, -1)}
  for j = 1, #bytes do
    local byte = bytes[j]
    if byte ~= 0 then
      local bits = positions[byte]
      if not bits then
        bits = {}
        for b = 0, 7 do
          if band(byte, bit.lshift(1, b)) ~= 0 then bits[#bits + 1] = b end
        end
        positions[byte] = bits
      end
      local base = (j - 1) * 8
      for _, b in ipairs(bits) do
        want[#want + 1] = base + b
        lens[#lens + 1] = len
      end
    end
  end
end
if #want == 0 then return cmsgpack.pack({}) end
local names = call('HMGET', NAMES, unpack(want))
for x, mid in ipairs(want) do
  local len = lens[x]
  local g, c, s = len, 0, 0
  if all then
    g = 0
    local at, mask = math.floor(mid / 8) + 1, bit.lshift(1, mid % 8)
    for r, run in ipairs(runs) do
      local first = run[1]
      if first >= len then break end
      local last = len
      if runs[r + 1] and runs[r + 1][1] < len then last = runs[r + 1][1] end
      local size = last - first
      if has_bit(run[2], at, mask) then g = g + size
      elseif has_bit(run[3], at, mask) then c = c + size
      else s = s + size end
    end
  end
  out[#out + 1] = names[x] or ''
  out[#out + 1] = len
  out[#out + 1] = g
  out[#out + 1] = c
  out[#out + 1] = s
end
-- One msgpack string rather than a Redis array: the client decodes it in one C call
-- instead of parsing a few hundred RESP items in Python.
return cmsgpack.pack(out)
"""
)

# Which members hold each of the given keys, per tier (no early stop: sliding-window
# and Mamba hits need blocks past a hole). ARGV: packed keys, then optional member
# names to restrict to. Returns a Redis array (bitmaps are binary, so not msgpack
# strings): {id, name, ...} of the members that occur, then {position, gpu bitmap,
# cpu bitmap, storage bitmap, ...} ('' for none) for every position someone holds.
PRESENCE = (
    _PRELUDE
    + r"""
if not nbuckets then return {{}, {}} end
local keys = ARGV[1]
local allowed = nil
local function and_str(a, b)
  if not a or not b then return a end
  local n = math.min(#a, #b)
  local x, y = {sbyte(a, 1, n)}, {sbyte(b, 1, n)}
  local last = 0
  for j = 1, n do
    local v = band(x[j], y[j])
    x[j] = v
    if v ~= 0 then last = j end
  end
  if last == 0 then return false end
  return schar(unpack(x, 1, last))
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
      v0, v1, v2 = and_str(v0, allowed), and_str(v1, allowed), and_str(v2, allowed)
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
"""
)

# What one member holds in this model: {e0, e1, e2} entry counts, or {} when nothing.
MEMBER_STATS = (
    _PRELUDE
    + r"""
local mid = member_id(ARGV[1])
if not mid then return {} end
local v = call('HMGET', STATS, 'e0:' .. mid, 'e1:' .. mid, 'e2:' .. mid)
return {tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0}
"""
)

# The keys one member holds (in a tier, or any with '') from one chunk of its reverse
# record, packed. ARGV: member, tier, offset, limit. Returns {packed keys, next or -1}.
MEMBER_KEYS = (
    _PRELUDE
    + r"""
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
"""
)

# Index-wide counts of one model: {k, t0, t1, t2, member names...}.
MODEL_STATS = (
    _PRELUDE
    + r"""
local v = call('HMGET', STATS, 'k', 't0', 't1', 't2')
local out = {tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0}
for _, name in ipairs(call('HKEYS', IDS)) do out[#out + 1] = name end
return out
"""
)


# -- stream leases (indexer/leases.py) ------------------------------------------------------
# KEYS: the stream's lease, position and digest keys (one hash tag: the member). The
# digest key holds the payload digest (hex) of the batch at the position, or is absent.

# Acquire or extend. ARGV: replica id, ttl ms, position to store ('' = unchanged; only
# written while the lease is ours, so a replica that lost a stream cannot move the next
# owner's resume point), its digest ('' = unknown: the old one is deleted with it).
# Returns {1, position, digest} when the lease was ours and is extended, {2, position,
# digest} when it was free and is now ours, {0, holder} when another replica holds it.
LEASE = r"""
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if ARGV[3] ~= '' then
    redis.call('SET', KEYS[2], ARGV[3])
    if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4]) else redis.call('DEL', KEYS[3]) end
  end
  return {1, redis.call('GET', KEYS[2]) or '', redis.call('GET', KEYS[3]) or ''}
end
if holder then return {0, holder} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {2, redis.call('GET', KEYS[2]) or '', redis.call('GET', KEYS[3]) or ''}
"""

# Compare-and-delete. ARGV: replica id, position ('' = unchanged), its digest.
LEASE_RELEASE = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2])
  if ARGV[3] ~= '' then redis.call('SET', KEYS[3], ARGV[3]) else redis.call('DEL', KEYS[3]) end
end
redis.call('DEL', KEYS[1])
return 1
"""


class Script:
    """A Lua script called by its SHA1 (EVALSHA), loaded on first NOSCRIPT."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def args(self, key: str | Sequence[str], argv: Sequence[Any]) -> tuple[Any, ...]:
        """The EVALSHA command for one call on ``key`` (or keys of one hash tag)."""
        keys = (key,) if isinstance(key, str) else tuple(key)
        return ("EVALSHA", self.sha, len(keys), *keys, *argv)


SCRIPTS = {
    name: Script(name, source)
    for name, source in (
        ("apply", APPLY),
        ("clear", CLEAR),
        ("lookup", LOOKUP),
        ("presence", PRESENCE),
        ("member_stats", MEMBER_STATS),
        ("member_keys", MEMBER_KEYS),
        ("model_stats", MODEL_STATS),
        ("lease", LEASE),
        ("lease_release", LEASE_RELEASE),
    )
}
