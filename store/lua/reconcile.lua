-- reconcile.lua: bring sessions' index entries in line with their values, whoever wrote them.
--
-- KEYS[3i-2]  session i's data key
-- KEYS[3i-1]  session i's fence hash (see save.lua; 'expires' is the value's expiry as we
--             last set it)
-- KEYS[3i]    session i's deadline index
--             (on a cluster every key of one call is in one slot: the caller groups by slot)
-- ARGV[1]     now in ms since epoch
-- ARGV[2]     tolerance in ms: an entry within this of the value's own deadline is left as is
-- ARGV[2+i]   session i's id (the index member)
--
-- Returns one outcome per session, in order: 0 when nothing changed; 1 when a value with no
-- index entry was adopted (written by a Go RedisStore alone), indexed at its own deadline
-- (now + PTTL; never, without a TTL); 2 when an entry's deadline was moved to the value's own
-- (another writer re-saved it); 3 when the entry of a value gone before its deadline (a direct
-- DEL) was dropped, and the fence no longer records a live value (a value gone after its
-- deadline is the sweep's, which announces the expiry). A value checkpointq wrote or
-- refreshed last is always in order: its fence's 'expires' still matches.
local now, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])

local function reconcile(data, fence, index, id)
  local expires = redis.call('PEXPIRETIME', data)
  local score = redis.call('ZSCORE', index, id)
  if expires == -2 then
    if not score or tonumber(score) <= now then
      return 0
    end
    redis.call('ZREM', index, id)
    redis.call('HDEL', fence, 'deadline', 'expires')
    return 3
  end
  if score and tonumber(redis.call('HGET', fence, 'expires') or -3) == expires then
    return 0
  end
  local ttl = redis.call('PTTL', data)
  local deadline = '+inf'
  if ttl >= 0 then
    deadline = now + ttl
  end
  if score then
    if deadline == '+inf' then
      if tonumber(score) == math.huge then
        return 0
      end
    elseif math.abs(tonumber(score) - deadline) <= tolerance then
      return 0
    end
  end
  redis.call('ZADD', index, deadline, id)
  -- A fence of ours that records a live value follows it to its new deadline.
  if redis.call('HGET', fence, 'deleted') == '0' then
    redis.call('HSET', fence, 'deadline', deadline)
  end
  if score then
    return 2
  end
  return 1
end

local outcomes = {}
for i = 1, #ARGV - 2 do
  outcomes[i] = reconcile(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], ARGV[2 + i])
end
return outcomes
