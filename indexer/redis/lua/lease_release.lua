-- Stream leases (indexer/redis/leases.py): KEYS as in lease.lua.
-- Compare-and-delete. ARGV: replica id, position ('' = unchanged), its digest.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2])
  if ARGV[3] ~= '' then redis.call('SET', KEYS[3], ARGV[3]) else redis.call('DEL', KEYS[3]) end
end
redis.call('DEL', KEYS[1])
return 1
