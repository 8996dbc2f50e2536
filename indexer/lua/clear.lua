-- Drop what one member holds, or compact its reverse record, one chunk of the record at
-- a time so a member with a million blocks never blocks Redis for long.
-- ARGV: member, tiers ('a' all, '0'..'2' one, '' none = compaction only), offset (in
-- entries), limit. Returns {entries dropped, next offset or -1 when done}.
-- With a single tier or none, the keys still held are written to log:<id>:tmp, which
-- replaces the record at the end.
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
          local nv = without_bit(v, at, mask)
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
