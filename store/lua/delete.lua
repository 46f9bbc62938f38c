-- delete.lua: apply a fenced delete of one session atomically, leaving a tombstone.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
-- KEYS[3]  deadline index
-- ARGV[1]  seq of this request
-- ARGV[2]  tombstone TTL in ms: how long an older save stays refused
-- ARGV[3]  session id (the index member)
--
-- Returns 1 when applied; 0 when stale (a newer save had already won). At equal seq a
-- delete wins, so a save and a delete stamped alike end deleted in either order.
local last = redis.call('HGET', KEYS[2], 'seq')
if last and tonumber(ARGV[1]) < tonumber(last) then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'deleted', '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
