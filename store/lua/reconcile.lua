-- reconcile.lua: bring one session's index entry in line with its value, whoever wrote it.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua; 'expires' is the value's expiry as we last set it)
-- KEYS[3]  deadline index
-- ARGV[1]  now in ms since epoch
-- ARGV[2]  session id (the index member)
-- ARGV[3]  tolerance in ms: an entry within this of the value's own deadline is left as is
--
-- Returns 0 when nothing changed; 1 when a value with no index entry was adopted (written by
-- a Go RedisStore alone), indexed at its own deadline (now + PTTL; never, without a TTL);
-- 2 when an entry's deadline was moved to the value's own (another writer re-saved it);
-- 3 when the entry of a value gone before its deadline (a direct DEL) was dropped, and the
-- fence no longer records a live value (a value gone after its deadline is the sweep's). A value checkpointq wrote or refreshed last is always in
-- order: its fence's 'expires' still matches.
local expires = redis.call('PEXPIRETIME', KEYS[1])
local score = redis.call('ZSCORE', KEYS[3], ARGV[2])
if expires == -2 then
  -- Gone after its deadline: it expired, and the sweep removes it and announces it.
  if not score or tonumber(score) <= tonumber(ARGV[1]) then
    return 0
  end
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('HDEL', KEYS[2], 'deadline', 'expires')
  return 3
end
if score and tonumber(redis.call('HGET', KEYS[2], 'expires') or -3) == expires then
  return 0
end
local ttl = redis.call('PTTL', KEYS[1])
local deadline = '+inf'
if ttl >= 0 then
  deadline = tonumber(ARGV[1]) + ttl
end
if score then
  if deadline == '+inf' then
    if tonumber(score) == math.huge then
      return 0
    end
  elseif math.abs(tonumber(score) - deadline) <= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('ZADD', KEYS[3], deadline, ARGV[2])
-- A fence of ours that records a live value follows it to its new deadline.
if redis.call('HGET', KEYS[2], 'deleted') == '0' then
  redis.call('HSET', KEYS[2], 'deadline', deadline)
end
if score then
  return 2
end
return 1
