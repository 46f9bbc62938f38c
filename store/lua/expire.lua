-- expire.lua: remove one session whose deadline has passed, if it still has, and if the
-- value is still the one that deadline belongs to.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua; 'expires' is the value's expiry as we last set it)
-- KEYS[3]  deadline index
-- ARGV[1]  now in ms since epoch
-- ARGV[2]  session id (the index member)
--
-- Returns 1 when the session is gone: this call deleted it, or found it already removed
-- (Redis's own TTL, or a direct DEL by another writer) and dropped its index entry.
-- Returns 0 when it was refreshed or saved since it was listed, another sweep got there
-- first, or another writer re-saved the value since we last wrote it: a Go RedisStore's
-- SET EX replaces our value and its expiry and updates no index. That value is never
-- deleted here; it is re-indexed at its own deadline (now + PTTL; never, without a TTL),
-- and Redis expires it. So concurrent sweeps expire a session once, and a sweep never
-- deletes a value that checkpointq did not write last.
-- The fence is kept (with its own TTL) so that a late, older save stays refused.
local score = redis.call('ZSCORE', KEYS[3], ARGV[2])
if not score or tonumber(score) > tonumber(ARGV[1]) then
  return 0
end
local expires = redis.call('PEXPIRETIME', KEYS[1])
if expires ~= -2 and tonumber(redis.call('HGET', KEYS[2], 'expires') or -3) ~= expires then
  local ttl = redis.call('PTTL', KEYS[1])
  local deadline = '+inf'
  if ttl >= 0 then
    deadline = tonumber(ARGV[1]) + ttl
  end
  redis.call('ZADD', KEYS[3], deadline, ARGV[2])
  if redis.call('HGET', KEYS[2], 'deleted') == '0' then
    redis.call('HSET', KEYS[2], 'deadline', deadline)
  end
  return 0
end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], 'deadline', 'expires')
return 1
