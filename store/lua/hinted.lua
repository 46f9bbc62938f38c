-- hinted.lua: the slots a cluster sweep must read now, from the sweep hint.
--
-- KEYS[1]  the sweep hint: sorted set of slot number -> earliest deadline (ms) known in
--          that slot's index, and member 'full' -> when the next full pass is due (ms)
-- ARGV[1]  now in ms since epoch
--
-- Returns the members scored at or before now (slot numbers, and 'full' when a full pass is
-- due), earliest first; or nil when the hint holds no 'full' member: it is missing, or was
-- recreated by a partial update (reconciliation's ZADD LT) before any full pass finished,
-- so it cannot vouch for the slots it does not name. Read-only.
if not redis.call('ZSCORE', KEYS[1], 'full') then
  return false
end
return redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE')
