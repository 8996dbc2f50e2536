-- Stream leases (indexer/redis/leases.py), not an index script: no prelude.
-- KEYS: the stream's lease, position and digest keys (one hash tag: the member). The
-- digest key holds the payload digest (hex) of the batch at the position, or is absent.
--
-- Acquire or extend. ARGV: replica id, ttl ms, position to store ('' = unchanged; only
-- written while the lease is ours, so a replica that lost a stream cannot move the next
-- owner's resume point), its digest ('' = unknown: the old one is deleted with it).
-- Returns {1, position, digest} when the lease was ours and is extended, {2, position,
-- digest} when it was free and is now ours, {0, holder} when another replica holds it.
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
