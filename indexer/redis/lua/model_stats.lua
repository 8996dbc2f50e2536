-- Index-wide counts of one model: {k, t0, t1, t2, member names...}.
local v = call('HMGET', STATS, 'k', 't0', 't1', 't2')
local out = {tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0}
for _, name in ipairs(call('HKEYS', IDS)) do out[#out + 1] = name end
return out
