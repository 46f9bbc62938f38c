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
-- KEYS[2]      the pending counts (publish.lua's): a settled request counts one less if
--              the count includes it, once (a session leaves the index only once its count
--              is spent)
-- KEYS[3..]    five per settled request, in ARGV order: its session's entries
--              (<prefix>.cq:pending-requests:<id>), its session's earlier-layout record
--              (<prefix>.cq:pending:<id>, removed only if it names this request and stamp),
--              its value (<prefix>.cq:pending-value:...), its earlier-layout value, and its
--              session's counted requests (<prefix>.cq:pending-counted:<id>, publish.lua's)
--
-- Which settle spends a count (tests/model/README.md, finding 6): the count includes a
-- request while its field in the counted requests holds its stamp; removing that field
-- (HDEL, 1 once) is what spends it, whether its entry is still there or went missing
-- (deleted by hand, evicted). A request whose entry is missing and that is not counted
-- spends nothing: a redelivered duplicate settled already, a request whose records expired
-- or went with the broker's data; the count it would spend is another request's, still
-- queued, for which loads must go on refusing. An entry of its own found without a counted
-- field (published before the counted requests, or their hash lost) was counted by its
-- publish, so removing it spends one. Counts from publishes before the counted requests
-- (by clients of an earlier release) are the counts no counted field explains: a settle
-- whose entry is missing spends one of those, as every such settle did before, only while
-- one is left.
--
-- Which delivery settles (finding 5): a request published again (its producer found the
-- broker lost it, while a worker held a delivery of it) is the latest publish's, whose
-- delivery tag its counted field names (publish.lua). A settle of another delivery tag
-- then leaves everything of the request (entry, value, count) to that publish's message,
-- still queued. A tag missing on either side (a message without one, a field written
-- before the tags, the orphan sweep) leaves the stamp alone to judge, as before.
-- ARGV[..]     six per settled request: session id, request id, seq ('' when the message
--              carried none that parses: then no entry is its own), op ('save' or
--              'delete'), what to do with its values: '0' keep them (a dead letter that
--              could not take the value leaves it for people, until its deadline), '1'
--              delete the value, '2' delete it and the earlier-layout value; and the
--              delivery tag of the message settled ('' unknown)
-- The values go only when no other request's entry or counted field holds the id. A
-- session whose entries are all gone and whose count is spent leaves the index (its counted
-- requests go too), and so does every index entry past its deadline (its entries expired
-- with it).
-- Returns the number of entries removed.

-- How many of session id's count no counted field and no entry explain: requests counted by
-- a publish before the counted requests (or whose counted field was lost) and missing.
local function uncounted(id, entries, counted)
  local left = (tonumber(redis.call('HGET', KEYS[2], id)) or 0) - redis.call('HLEN', counted)
  for _, req in ipairs(redis.call('HKEYS', entries)) do
    if left <= 0 then
      break
    end
    left = left - (1 - redis.call('HEXISTS', counted, req))
  end
  return left
end

local removed = 0
local settled = #ARGV / 6
for i = 1, settled do
  local a, k = 6 * (i - 1), 2 + 5 * (i - 1)
  local id, req, seq, op, values = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local entries, legacy, counted = KEYS[k + 1], KEYS[k + 2], KEYS[k + 5]
  local ours, spent = true, false
  local stamp = seq .. ' ' .. op
  local mine = redis.call('HGET', counted, req)
  local owner = mine and string.match(mine, '^%S+ %S+ (%S+)$') or ''
  mine = mine and string.match(mine, '^%S+ %S+') or mine
  local entry = redis.call('HGET', entries, req)
  if mine == stamp and owner ~= '' and ARGV[a + 6] ~= '' and owner ~= ARGV[a + 6] then
    ours, entry, mine = false, nil, nil -- a later publish's: its own message settles it
  end
  if entry then
    if seq ~= '' and entry == stamp then
      removed = removed + redis.call('HDEL', entries, req)
      spent = true
    else
      ours = false
    end
  end
  if mine and (seq == '' or mine ~= stamp) then
    ours = false -- counted as another request (its entry gone): nothing of it is ours
  elseif ours and seq ~= '' then
    if mine then
      redis.call('HDEL', counted, req)
      spent = true
    elseif not entry and uncounted(id, entries, counted) > 0 then
      spent = true -- the rule before the counted requests, for a count from then
    end
  end
  if spent then
    redis.call('HINCRBY', KEYS[2], id, '-1')
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
    redis.call('DEL', counted)
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
  string.format('(%d', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
return removed
