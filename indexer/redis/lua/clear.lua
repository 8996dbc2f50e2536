-- Drop what one member holds, or compact its reverse record, one chunk of the record at
-- a time so a member with a million blocks never blocks Redis for long. The client read
-- the chunk first (GETRANGE) to name the buckets its keys fall in.
-- KEYS: the six fixed keys, the member's reverse record and its rewrite key
-- (ModelKeys.log, log_tmp), then the buckets of the chunk's keys.
-- ARGV: the bucket count the client assumed, member, tiers ('a' all, '0'..'2' one, ''
-- none = compaction only), offset (in entries), limit, the chunk as the client read it,
-- and per key of the chunk the KEYS position of its bucket (two bytes each).
-- Returns {entries dropped, next offset or -1 when done}, or {0, -2} without writing
-- anything when the record or the bucket count is not what the client read (it reads
-- the chunk again).
-- With a single tier or none, the keys still held are appended to the rewrite key,
-- which replaces the record at the end.
if not nbuckets then return {0, -1} end
local logkey, tmpkey = KEYS[7], KEYS[8]
local name, which = ARGV[2], ARGV[3]
local offset, limit, seen_chunk, positions = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7]
local chunk = call('GETRANGE', logkey, offset * 8, (offset + limit) * 8 - 1)
if nbuckets ~= tonumber(ARGV[1]) or ssub(chunk, 1, #seen_chunk) ~= seen_chunk then
  return {0, -2}
end
local mid = member_id(name)
if not mid then return {0, -1} end
local scope = {}
if which == 'a' then scope = {[0] = true, true, true}
elseif which ~= '' then scope[tonumber(which)] = true end
local at, mask = math.floor(mid / 8) + 1, bit.lshift(1, mid % 8)
local all = multi_tier()
local seen, kept = {}, {}
local dropped = 0
for i = 1, #seen_chunk, 8 do
  local k = ssub(seen_chunk, i, i + 7)
  if not seen[k] then
    seen[k] = true
    local bkey = bucket_at(positions, (i + 7) / 8)
    local v0, v1, v2 = values(bkey, k, all)
    local vals = {[0] = v0, v1, v2}
    local held_before, held_after, live_after = false, false, false
    for t = 0, 2 do
      local v = vals[t]
      if has_bit(v, at, mask) then
        held_before = true
        if scope[t] then
          v = clear_bit(bkey, k .. SUFFIX[t], v, at, mask)
          add_stat('t' .. t, -1)
          add_stat('e' .. t .. ':' .. mid, -1)
          drop_copies(k, t, mid)
          dropped = dropped + 1
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
-- Done when the client's chunk was the record's last (a record that grew since the
-- client read it goes on from the next offset).
local done = #seen_chunk < limit * 8 and #chunk == #seen_chunk
if which ~= 'a' and #kept > 0 then call('APPEND', tmpkey, table.concat(kept)) end
if done then
  if which == 'a' then
    call('DEL', logkey, tmpkey)
  elseif call('EXISTS', tmpkey) == 1 then
    call('RENAME', tmpkey, logkey)
  else
    call('DEL', logkey)
  end
  if get_stat('h:' .. mid) <= 0 then release(mid, name, logkey, tmpkey) end
end
flush_stats()
return {dropped, done and -1 or offset + #seen_chunk / 8}
