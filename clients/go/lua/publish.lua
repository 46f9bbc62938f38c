-- Push one message onto the queue and record, per session it carries, the newest accepted
-- request (docs/protocol.md, "Pending records"), atomically: a load that reads the record
-- sees every request the queue holds, and no record exists for a message that was not pushed.
--
-- KEYS[1]      the queue (a list)
-- KEYS[2]      the pending index: sorted set, session id -> record deadline (ms, server time)
-- KEYS[3]      the pending epoch: a token that changes only when the broker lost its data
-- KEYS[4..]    one pending record key per request in the message (<prefix>.cq:pending:<id>),
--              then one staged value key per "staged" request, in the same order
--              (<prefix>.cq:pending-value:<request id>, SET by the caller just before)
-- ARGV[1]      the message, as LPUSH stores it; or "" when the caller LPUSHes it itself in
--              the same MULTI/EXEC, just before this script (the message then never passes
--              through Lua, which copies every argument: worth it for large messages only)
-- ARGV[2]      the records' lifetime, ms
-- ARGV[3]      a fresh random token, the epoch if the broker has none yet
-- ARGV[4..]    five per record, in KEYS order: session id, seq, op ("save" | "delete" |
--              "staged"), request id, value (save: the stored value; delete, staged: "")
-- A "staged" request is a save whose value waits in its staged value key (docs/protocol.md,
-- "Staged saves"): its record says where, and the key lives as long as the message may.
-- Returns the epoch.
local ttl = tonumber(ARGV[2])
local records = (#ARGV - 3) / 5
-- A staged message without its value could never be applied: refuse it before any write.
for i = 4 + records, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('ERR staged value ' .. KEYS[i] .. ' is missing')
  end
end
-- The push is the script's first write: a broker at maxmemory refuses it (OOM) before
-- anything changed. Redis lets a script that has written go on past maxmemory, so a DEL
-- first would have let every later write through.
if ARGV[1] ~= '' then
  redis.call('LPUSH', KEYS[1], ARGV[1])
end
local epoch = redis.call('GET', KEYS[3])
if not epoch then
  redis.call('SET', KEYS[3], ARGV[3])
  epoch = ARGV[3]
end
local now = redis.call('TIME')
local deadline = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + ttl
local staged = 4 + records
for i = 4, 3 + records do
  local a = 4 + (i - 4) * 5
  local seq, op = tonumber(ARGV[a + 1]), ARGV[a + 2]
  local value_key = nil
  if op == 'staged' then
    -- The message needs its value for as long as it may be delivered, whether or not its
    -- record wins below.
    value_key, op, staged = KEYS[staged], 'save', staged + 1
    redis.call('PEXPIRE', value_key, ttl)
  end
  local current = redis.call('HMGET', KEYS[i], 'seq', 'op')
  local held = tonumber(current[1])
  -- The newest request wins; at equal seq a delete wins over a save, as in the store.
  if held == nil or seq > held or (seq == held and op == 'delete' and current[2] ~= 'delete') then
    redis.call('DEL', KEYS[i])
    if value_key then
      redis.call('HSET', KEYS[i], 'seq', ARGV[a + 1], 'op', op, 'req', ARGV[a + 3],
        'staged', value_key)
    elseif op == 'save' then
      redis.call('HSET', KEYS[i], 'seq', ARGV[a + 1], 'op', op, 'req', ARGV[a + 3],
        'value', ARGV[a + 4])
    else
      redis.call('HSET', KEYS[i], 'seq', ARGV[a + 1], 'op', op, 'req', ARGV[a + 3])
    end
    redis.call('PEXPIRE', KEYS[i], ttl)
    redis.call('ZADD', KEYS[2], deadline, ARGV[a])
  end
end
return epoch
