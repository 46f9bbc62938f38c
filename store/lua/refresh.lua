-- refresh.lua: extend a live session's lifetime without rewriting its value.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
-- KEYS[3]  deadline index
-- ARGV[1]  session TTL in ms
-- ARGV[2]  new deadline in ms since epoch
-- ARGV[3]  fence TTL in ms
-- ARGV[4]  session id (the index member)
--
-- Returns 1 when refreshed; 0 when the session is absent (its stale index entry, if the
-- value expired on its own, is dropped on the way).
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then
  redis.call('ZREM', KEYS[3], ARGV[4])
  return 0
end
-- 'expires' as in save.lua: the value's expiry now carries our deadline, whoever wrote it.
redis.call('HSET', KEYS[2], 'deadline', ARGV[2], 'expires', redis.call('PEXPIRETIME', KEYS[1]))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4])
return 1
