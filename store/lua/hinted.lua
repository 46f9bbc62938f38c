-- hinted.lua: the slots a cluster sweep must read now, from the sweep hint.
--
-- KEYS[1]  the sweep hint: sorted set of slot number -> earliest deadline (ms) known in
--          that slot's index, and member 'full' -> when the next full pass is due (ms)
-- ARGV[1]  now in ms since epoch
-- ARGV[2]  at most this many slots
--
-- Returns {'full'} when a full pass is due; else the slots scored at or before now,
-- earliest first, at most ARGV[2] of them; or nil when the hint holds no 'full' member: it
-- is missing, or was recreated by a partial update (reconciliation's ZADD LT) before any
-- full pass finished, so it cannot vouch for the slots it does not name. Read-only.
local full = redis.call('ZSCORE', KEYS[1], 'full')
if not full then
  return false
end
if tonumber(full) <= tonumber(ARGV[1]) then
  return {'full'}
end
return redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, ARGV[2])
