-- save.lua: apply a fenced save of one session atomically.
--
-- KEYS[1]  data key: the checkpoint value (Go-compatible zstd JSON)
-- KEYS[2]  fence hash: seq (last applied), deleted ("1" for a tombstone), deadline (ms),
--          req (the id of the request that set it; "" when its producer sent none)
-- KEYS[3]  deadline index: sorted set of session id -> deadline (ms since epoch)
-- KEYS[4]  staged saves only: a staging key holding the value, written by the caller just
--          before this call (KeySpace.staging). It is renamed onto KEYS[1] when the save
--          applies and deleted when it is stale, so it never outlives the call.
-- ARGV[1]  seq of this request (integer below 2^53, so exact as a Lua number)
-- ARGV[2]  value to store ("" and unused when KEYS[4] holds it)
-- ARGV[3]  session TTL in ms
-- ARGV[4]  deadline in ms since epoch (now + TTL, computed by the caller)
-- ARGV[5]  fence TTL in ms (session TTL + tombstone TTL: fencing outlives the data)
-- ARGV[6]  session id (the index member)
-- ARGV[7]  request id ("" or absent: none)
--
-- Returns 1 when applied (or applied again: a duplicate of the request the fence names);
-- 0 when stale: the fence holds a request ordered after this one (store/ordering.py: by
-- seq, then a delete over a save, then the request id byte by byte), so a request that lost
-- can never apply later and its producer can be told so. A fence set by a lapsed save
-- (deleted = '2') ranks as a save.
-- A staged save whose staging key is gone (its SET was refused, or it expired before the
-- call ran) changes nothing and fails with an error, so that the caller retries it.
local function before(a, b) -- a < b byte by byte (Lua's < follows the server's locale)
  local i = 1
  while i <= #a and i <= #b and a:byte(i) == b:byte(i) do i = i + 1 end
  return (b:byte(i) or -1) > (a:byte(i) or -1)
end
local req = ARGV[7] or ''
local staged = KEYS[4]
local last = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req')
if last[1] then
  local seq, last_seq, last_req = tonumber(ARGV[1]), tonumber(last[1]), last[3] or ''
  if seq < last_seq or (seq == last_seq and (last[2] == '1' or before(req, last_req))) then
    if staged then
      redis.call('DEL', staged)
    end
    return 0
  end
end
if staged then
  if redis.call('EXISTS', staged) == 0 then
    return redis.error_reply('ERR checkpointq: staged value missing, save not applied')
  end
  -- RENAME moves the value without copying it (passing it as ARGV costs Redis a copy into
  -- Lua and another out of it); the staging key's own short TTL is replaced below.
  redis.call('RENAME', staged, KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'deleted', '0', 'deadline', ARGV[4], 'req', req)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[6])
-- Fence field 'expires': the value's own expiry as Redis keeps it (PEXPIRETIME, absolute ms).
-- The sweep deletes the value only while it still carries this expiry, i.e. while no other
-- writer (Go's SET EX) has replaced it since.
redis.call('HSET', KEYS[2], 'expires', redis.call('PEXPIRETIME', KEYS[1]))
return 1
