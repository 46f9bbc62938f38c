-- delete.lua: apply a fenced delete of one session atomically, leaving a tombstone.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
-- KEYS[3]  deadline index
-- ARGV[1]  seq of this request
-- ARGV[2]  tombstone TTL in ms: how long an older save stays refused
-- ARGV[3]  session id (the index member)
-- ARGV[4]  request id ("" or absent: none)
--
-- Returns 1 when applied; 0 when stale (a newer request had already won, or another
-- delete with the same seq). At equal seq a delete wins over a save, so a save and a
-- delete stamped alike end deleted in either order.
local req = ARGV[4] or ''
local last = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req')
if last[1] then
  local seq, last_seq = tonumber(ARGV[1]), tonumber(last[1])
  if seq < last_seq or (seq == last_seq and last[2] == '1' and (last[3] or '') ~= req) then
    return 0
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'deleted', '1', 'req', req)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
