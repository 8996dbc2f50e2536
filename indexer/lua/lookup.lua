-- Longest held prefix of a chain, per member. ARGV: packed chain keys, then optionally
-- the candidate members. Walks the chain in order, a chunk of blocks per read, and stops
-- at the first block no remaining candidate holds. Consecutive blocks usually have
-- identical bitmaps (the same pods stored the whole prefix), so most blocks cost a
-- string comparison; bitmaps are intersected only where they change.
-- Returns, msgpack-encoded, a flat array: member, matched blocks, GPU, CPU, STORAGE, ...
if not nbuckets then return cmsgpack.pack({}) end
local chain = ARGV[1]
local alive = nil

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
