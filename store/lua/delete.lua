-- delete.lua: apply a fenced delete of one session atomically, leaving a tombstone; or, with
-- ARGV[5] = '2', settle a save that arrived past its deadline (store/ordering.py) without
-- storing it: had it been applied on time its session would have expired by now, so if it
-- is ordered after the fence the value (an older request's, which a refresh may have kept
-- alive) goes, and the fence records the lapsed save, keeping out every request ordered
-- before it as a tombstone does.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua); 'deleted' is '1' for a tombstone, '2' for a lapsed save
-- KEYS[3]  deadline index
-- ARGV[1]  seq of this request
-- ARGV[2]  fence TTL in ms: until every request ordered before it is past its deadline, plus
--          the tombstone margin (CheckpointStore.tombstone_expiry_ms)
-- ARGV[3]  session id (the index member)
-- ARGV[4]  request id ("" or absent: none)
-- ARGV[5]  '1' (a delete; the default) or '2' (a lapsed save)
--
-- Returns 1 when applied (a delete's duplicate applies again); 0 when the fence holds a
-- request ordered after this one (store/ordering.py), or, for a lapsed save, this one. At
-- equal seq a delete wins over a save, so a save and a delete stamped alike end deleted in
-- either order; requests of one kind stamped alike are ordered by request id.
local function before(a, b) -- a < b byte by byte (Lua's < follows the server's locale)
  local i = 1
  while i <= #a and i <= #b and a:byte(i) == b:byte(i) do i = i + 1 end
  return (b:byte(i) or -1) > (a:byte(i) or -1)
end
local req, kind = ARGV[4] or '', ARGV[5] or '1'
local last = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req')
if last[1] then
  local seq, last_seq, last_req = tonumber(ARGV[1]), tonumber(last[1]), last[3] or ''
  local tie_lost
  if kind == '1' then
    tie_lost = last[2] == '1' and before(req, last_req)
  else
    tie_lost = last[2] == '1' or not before(last_req, req)
  end
  if seq < last_seq or (seq == last_seq and tie_lost) then
    return 0
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'seq', ARGV[1], 'deleted', kind, 'req', req)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
