-- Remove the pending records that settled requests made obsolete (docs/protocol.md,
-- "Pending records"): run by the worker once requests are applied, superseded or
-- dead-lettered, in the round trip that acknowledges their messages.
--
-- KEYS[1]      the pending index: sorted set, session id -> record deadline (ms)
-- KEYS[2..]    one pending record key per settled request (<prefix>.cq:pending:<id>), then
--              the staged value key of each settled staged save
--              (<prefix>.cq:pending-value:<request id>), deleted: its message is done
-- ARGV[..]     two per settled request, in KEYS order: session id, seq
-- A record goes, with its index entry, iff its seq is <= the settled request's: a higher
-- one names a newer request still on its way. A staged value goes only with its own
-- request: an older request's message may still need its own. An index entry whose record
-- is gone (expired) goes too, and so does every entry past its deadline.
-- Returns the number of records removed.
local removed = 0
local records = #ARGV / 2
for i = 2 + records, #KEYS do
  redis.call('DEL', KEYS[i])
end
for i = 2, 1 + records do
  local id, seq = ARGV[2 * i - 3], tonumber(ARGV[2 * i - 2])
  local held = tonumber(redis.call('HGET', KEYS[i], 'seq'))
  if held == nil then
    redis.call('ZREM', KEYS[1], id)
  elseif held <= seq then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[1], id)
    removed = removed + 1
  end
end
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf',
  '(' .. (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
return removed
