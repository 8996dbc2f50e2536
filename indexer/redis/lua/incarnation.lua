-- Index incarnation (indexer/redis/incarnation.py), not an index script: no prelude.
-- KEYS: the incarnation key (a token written with the index) and the rebuilds hash
-- (member -> '<state>\t<model>' of its stream's rebuild after the last loss).
-- ARGV: the token this replica knows ('' = none yet), a fresh token, the number n of
-- members that follow, n members this replica knows streams of, then (member, value)
-- pairs: rebuild states this replica's streams reached.
--
-- A missing key means Redis lost the index (restarted empty, flushed): the fresh token
-- becomes the incarnation and the old rebuild states go. A token other than the known
-- one means another replica saw the loss first. Either way the loss is this replica's
-- to report: its streams are recorded as 'rebuilding' unless a state is already there
-- (an owner that finished first must not be set back), and the states it brings from
-- before it knew are dropped. Otherwise its states are written, for members that have
-- an entry only. Returns {lost (0/1), the token, member, value, ... of entries not live}.
local current = redis.call('GET', KEYS[1])
local lost = 0
if not current then
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('DEL', KEYS[2])
  current = ARGV[2]
  if ARGV[1] ~= '' then lost = 1 end
elseif ARGV[1] ~= '' and current ~= ARGV[1] then
  lost = 1
end
local n = tonumber(ARGV[3])
if lost == 1 then
  for i = 4, 3 + n do redis.call('HSETNX', KEYS[2], ARGV[i], 'rebuilding\t') end
elseif ARGV[1] ~= '' then
  for i = 4 + n, #ARGV, 2 do
    if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
      redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    end
  end
end
local out = {lost, current}
local entries = redis.call('HGETALL', KEYS[2])
for i = 1, #entries, 2 do
  if string.sub(entries[i + 1], 1, 5) ~= 'live\t' then
    out[#out + 1] = entries[i]
    out[#out + 1] = entries[i + 1]
  end
end
return out
