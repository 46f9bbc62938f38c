-- save.lua: apply a fenced save of one session atomically.
--
-- KEYS[1]  data key: the checkpoint value (Go-compatible zstd JSON)
-- KEYS[2]  fence hash: seq (last applied), deleted ("1" for a tombstone), deadline (ms),
--          req (the id of the request that set it; "" when its producer sent none)
-- KEYS[3]  deadline index: sorted set of session id -> deadline (ms since epoch)
-- ARGV[1]  seq of this request (integer below 2^53, so exact as a Lua number)
-- ARGV[2]  value to store
-- ARGV[3]  session TTL in ms
-- ARGV[4]  deadline in ms since epoch (now + TTL, computed by the caller)
-- ARGV[5]  fence TTL in ms (session TTL + tombstone TTL: fencing outlives the data)
-- ARGV[6]  session id (the index member)
-- ARGV[7]  request id ("" or absent: none)
--
-- Returns 1 when applied; 0 when stale: a newer request won, or one with the same seq did
-- (a delete, or another request: at equal seq only a duplicate of the winner re-applies,
-- so a request that lost can never apply later and its producer can be told so).
local req = ARGV[7] or ''
local last = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req')
if last[1] then
  local seq, last_seq = tonumber(ARGV[1]), tonumber(last[1])
  if seq < last_seq or (seq == last_seq and (last[2] == '1' or (last[3] or '') ~= req)) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'deleted', '0', 'deadline', ARGV[4], 'req', req)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[6])
-- Fence field 'expires': the value's own expiry as Redis keeps it (PEXPIRETIME, absolute ms).
-- The sweep deletes the value only while it still carries this expiry, i.e. while no other
-- writer (Go's SET EX) has replaced it since.
redis.call('HSET', KEYS[2], 'expires', redis.call('PEXPIRETIME', KEYS[1]))
return 1
