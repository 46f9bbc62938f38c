-- Remove the pending entries of requests the worker is done with (docs/protocol.md, "Pending
-- records"): run once requests are applied, superseded, lapsed or dead-lettered, in the
-- round trip that acknowledges their messages. Each request removes its own entry and
-- value, and nothing else: an entry of another request, even one stamped alike, names a
-- request still on its way (issue 31: settling a save by seq alone once removed a delete's
-- record stamped alike, and a deleted conversation came back). An entry is the request's
-- own when its id and its stamp (seq and op) both match: a message that carries another
-- request's id with another stamp (a faulty producer's, refused by the worker) settles
-- nothing of that request, neither its entry nor its staged value.
--
-- KEYS[1]      the pending index: sorted set, session id -> latest entry deadline (ms)
-- KEYS[2]      the pending counts (publish.lua's): a removed entry counts one less, and
--              so does a request whose entry is missing while the counts say one is (a
--              session leaves the index only once its count is spent)
-- KEYS[3..]    four per settled request, in ARGV order: its session's entries
--              (<prefix>.cq:pending-requests:<id>), its session's earlier-layout record
--              (<prefix>.cq:pending:<id>, removed only if it names this request and stamp),
--              its value (<prefix>.cq:pending-value:...) and its earlier-layout value
-- ARGV[..]     five per settled request: session id, request id, seq ('' when the message
--              carried none that parses: then no entry is its own), op ('save' or
--              'delete'), and what to do with its values: '0' keep them (a dead letter that
--              could not take the value leaves it for people, until its deadline), '1'
--              delete the value, '2' delete it and the earlier-layout value
-- The values go only when no other request's entry holds the id. A session whose entries
-- are all gone leaves the index, and so does every index entry past its deadline (its
-- entries expired with it).
-- Returns the number of entries removed.
local removed = 0
local settled = #ARGV / 5
for i = 1, settled do
  local a, k = 5 * (i - 1), 2 + 4 * (i - 1)
  local id, req, seq, op, values = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local entries, legacy = KEYS[k + 1], KEYS[k + 2]
  local ours = true
  local entry = redis.call('HGET', entries, req)
  if entry then
    if seq ~= '' and entry == seq .. ' ' .. op then
      removed = removed + redis.call('HDEL', entries, req)
      redis.call('HINCRBY', KEYS[2], id, -1)
    else
      ours = false
    end
  elseif seq ~= '' and (tonumber(redis.call('HGET', KEYS[2], id)) or 0)
      > redis.call('HLEN', entries) then
    -- Its entry is missing (deleted by hand, evicted) and the counts say so: this is one
    -- of the requests loads refuse to answer for; one fewer is left to land.
    redis.call('HINCRBY', KEYS[2], id, -1)
  end
  local old = redis.call('HMGET', legacy, 'req', 'seq', 'op')
  if old[1] == req then
    if seq ~= '' and old[2] == seq and old[3] == op then
      redis.call('DEL', legacy)
      removed = removed + 1
    else
      ours = false
    end
  end
  if redis.call('EXISTS', entries, legacy) == 0
      and (tonumber(redis.call('HGET', KEYS[2], id)) or 0) <= 0 then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  end
  if ours and values ~= '0' then
    redis.call('DEL', KEYS[k + 3])
    if values == '2' then
      redis.call('DEL', KEYS[k + 4])
    end
  end
end
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf',
  '(' .. (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
return removed
