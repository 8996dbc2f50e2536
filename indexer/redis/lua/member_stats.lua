-- What one member holds in this model: {e0, e1, e2} entry counts, or {} when nothing.
local mid = member_id(ARGV[1])
if not mid then return {} end
local v = call('HMGET', STATS, 'e0:' .. mid, 'e1:' .. mid, 'e2:' .. mid)
return {tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0}
