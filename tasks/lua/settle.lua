-- Remove the pending entries of requests the worker is done with (docs/protocol.md, "Pending
-- records"): run once requests are applied, superseded, lapsed or dead-lettered, in the
-- round trip that acknowledges their messages. Each request removes its own entry and
-- value, and nothing else: an entry of another request, even one stamped alike, names a
-- request still on its way (issue 31: settling a save by seq alone once removed a delete's
-- record stamped alike, and a deleted conversation came back).
--
-- KEYS[1]      the pending index: sorted set, session id -> latest entry deadline (ms)
-- KEYS[2..]    two per settled request, in ARGV order: its session's entries
--              (<prefix>.cq:pending-requests:<id>) and its session's earlier-layout record
--              (<prefix>.cq:pending:<id>, removed only if it names this request); then the
--              value keys to delete (each settled save's own value, unless its dead letter
--              leaves it for people to look at)
-- ARGV[..]     two per settled request: session id, request id
-- A session whose entries are all gone leaves the index, and so does every index entry
-- past its deadline (its entries expired with it).
-- Returns the number of entries removed.
local removed = 0
local settled = #ARGV / 2
for i = 1, settled do
  local id, req = ARGV[2 * i - 1], ARGV[2 * i]
  local entries, legacy = KEYS[2 * i], KEYS[2 * i + 1]
  removed = removed + redis.call('HDEL', entries, req)
  if redis.call('HGET', legacy, 'req') == req then
    redis.call('DEL', legacy)
    removed = removed + 1
  end
  if redis.call('EXISTS', entries, legacy) == 0 then
    redis.call('ZREM', KEYS[1], id)
  end
end
for i = 2 + 2 * settled, #KEYS do
  redis.call('DEL', KEYS[i])
end
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf',
  '(' .. (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
return removed
