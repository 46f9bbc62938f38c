-- Read the newest pending request of sessions from the broker (docs/protocol.md, "Pending
-- records"): of a session's entries (one per request the queue may still hold, written by
-- publish.lua, removed one by one by settle.lua), the one ordered last (store/ordering.py:
-- by seq, then a delete over a save, then the request id byte by byte). A record of the
-- earlier layout (<prefix>.cq:pending:<id>, one hash per session, written by producers
-- before issue 31) takes part as one more entry. clients/go/lua/read_pending.lua is the
-- Go client's copy, byte for byte.
--
-- ARGV[1]  the mode:
--   'one'    KEYS: the session's entries, the pending epoch, its earlier-layout record,
--            the pending mark (publish.lua's counter), the pending index, the pending
--            counts. ARGV[2]: the
--            session's value key prefix (<prefix>.cq:pending-value:<n>:<id>:, to which a
--            save's request id is appended), ARGV[3]: the session TTL in ms, ARGV[4]: the
--            session id; ARGV[5], ARGV[6] (optional): the highest mark the caller saw
--            and its token (publish.lua's ARGV[7..8]).
--            Returns {seq, op, req, value, epoch, mark, forked, token}: op 'save' with its value,
--            'delete', or 'lapsed' (a save past its deadline: never to be stored, its
--            session reads as expired); false for each when there is no entry. Op
--            'missing' (seq false) instead when the index still holds the session (a
--            request of it is queued) and fewer entries are left than the counts say:
--            deleted by hand or evicted, not settled (settle.lua counts each it removes,
--            and removes the index entry with the last one). A missing record is not an
--            applied one: the caller must not serve an older answer. forked: 1 when the
--            ring's slot of ARGV[5] holds that mark with another token than ARGV[6] (the
--            broker lost it and gave it again: a loss, as a mark below ARGV[5] is), else 0;
--            token: the current mark's token, false when its slot holds another mark.
--   'store'  KEYS: as 'one', then the session's data key and fence hash, on this same
--            Redis (one Redis for broker and store). ARGV as 'one'. Returns 'one's first
--            five, then {stored value, fence seq, deleted, req, deadline}: a save entry's
--            value only when the entry is ordered after the fence, the stored value only
--            when it is not (a load needs one of them); then the mark, forked and token.
--   'heads'  KEYS: per session, its entries then its earlier-layout record. ARGV[2]: the
--            session TTL in ms. Returns {seq, op, req} per session, false where none.
-- A value key named from the prefix, not in KEYS, is allowed on a single Redis: pending
-- records never live on a cluster. Read-only.
local mode, now = ARGV[1], redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl = tonumber(mode == 'heads' and ARGV[2] or ARGV[3])

local function before(a, b) -- a < b byte by byte (Lua's < follows the server's locale)
  local i = 1
  while i <= #a and i <= #b and a:byte(i) == b:byte(i) do i = i + 1 end
  return (b:byte(i) or -1) > (a:byte(i) or -1)
end

-- Whether request (seq, delete?, req) is ordered after (seq2, delete2?, req2).
local function after(seq, del, req, seq2, del2, req2)
  if seq ~= seq2 then
    return seq > seq2
  elseif del ~= del2 then
    return del
  end
  return before(req2, req)
end

-- The entry ordered last: {seq text, op, req, value key or false}; nil when none.
local function head(entries, legacy, prefix)
  local best
  local flat = redis.call('HGETALL', entries)
  for i = 1, #flat, 2 do
    local seq, op = string.match(flat[i + 1], '^(%d+) (%a+)$')
    if seq and (not best or after(tonumber(seq), op == 'delete', flat[i],
        tonumber(best[1]), best[2] == 'delete', best[3])) then
      best = {seq, op, flat[i], prefix and (prefix .. flat[i])}
    end
  end
  local old = redis.call('HMGET', legacy, 'seq', 'op', 'req', 'staged')
  if old[1] and (not best or after(tonumber(old[1]), old[2] == 'delete', old[3] or '',
      tonumber(best[1]), best[2] == 'delete', best[3])) then
    -- its value is in the record itself, or in the staged key it names
    best = {old[1], old[2], old[3] or '', old[4] or {legacy}}
  end
  if best and best[2] == 'save' and tonumber(best[1]) >= 1577836800000000
      and math.floor(tonumber(best[1]) / 1000) + ttl <= now_ms then
    best[2] = 'lapsed'
  end
  return best
end

local function value(best)
  if not best or best[2] ~= 'save' then
    return false
  elseif type(best[4]) == 'table' then
    return redis.call('HGET', best[4][1], 'value')
  end
  return redis.call('GET', best[4])
end

if mode == 'heads' then
  local out = {}
  for i = 1, #KEYS, 2 do
    local best = head(KEYS[i], KEYS[i + 1], nil) or {false, false, false}
    out[#out + 1], out[#out + 2], out[#out + 3] = best[1], best[2], best[3]
  end
  return out
end

local best = head(KEYS[1], KEYS[3], ARGV[2])
local epoch = redis.call('GET', KEYS[2])
local mark = redis.call('HGET', KEYS[4], 'n')

-- The token of a mark, from the ring in the pending mark (publish.lua): false when its slot
-- holds another mark (overwritten 65536 publishes later, or never written).
local function token(of)
  local at, held = string.match(redis.call('HGET', KEYS[4],
    string.format('t%d', tonumber(of) % 65536)) or '', '^(%d+):(.+)$')
  return at == of and held
end

local forked = 0
if ARGV[6] and ARGV[6] ~= '' then
  local held = token(ARGV[5])
  forked = (held and held ~= ARGV[6]) and 1 or 0
end
local current = mark and token(mark) or false
local none = best or {false, false, false}
local due = tonumber(redis.call('ZSCORE', KEYS[5], ARGV[4]))
if due and due > now_ms and (tonumber(redis.call('HGET', KEYS[6], ARGV[4])) or 0)
    > redis.call('HLEN', KEYS[1]) then
  best, none = nil, {false, 'missing', false}
elseif not best and due and due > now_ms and redis.call('EXISTS', KEYS[3]) == 0 then
  none[2] = 'missing' -- no entry left, none counted (a deployment before the counts)
end
if mode == 'one' then
  return {none[1], none[2], none[3], value(best), epoch, mark, forked, current}
end
local fence = redis.call('HMGET', KEYS[8], 'seq', 'deleted', 'req', 'deadline')
local answers = best and (not fence[1] or after(tonumber(best[1]), best[2] == 'delete', best[3],
  tonumber(fence[1]), fence[2] == '1', fence[3] or ''))
return {none[1], none[2], none[3], answers and value(best) or false, epoch,
  (not answers) and redis.call('GET', KEYS[7]) or false, fence[1], fence[2], fence[3], fence[4],
  mark, forked, current}
