-- expire.lua: remove one session whose deadline has passed, if it still has.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
-- KEYS[3]  deadline index
-- ARGV[1]  now in ms since epoch
-- ARGV[2]  session id (the index member)
--
-- Returns 1 when this call expired the session; 0 when it was refreshed or saved since it
-- was listed, or another sweep got there first. So concurrent sweeps expire a session once.
-- The fence is kept (with its own TTL) so that a late, older save stays refused.
local score = redis.call('ZSCORE', KEYS[3], ARGV[2])
if not score or tonumber(score) > tonumber(ARGV[1]) then
  return 0
end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], 'deadline')
return 1
