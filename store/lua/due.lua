#!lua flags=no-writes,allow-cross-slot-keys
-- due.lua: the due sessions of many deadline indexes of one Redis Cluster node, in one call.
--
-- The one script whose keys come in ARGV: it reads the indexes of many slots, and Redis
-- Cluster refuses a command whose declared KEYS span slots before any script flag is looked
-- at. So it is sent to a node directly (never routed by key), and every index named must be
-- in a slot that node serves: Redis refuses the call otherwise ('non local key'), and the
-- caller regroups the slots by node. Read-only. A sweep of a cluster calls it a few times
-- per node instead of sending one ZRANGE per slot (16384 of them).
--
-- ARGV[1]  now in ms since epoch
-- ARGV[2]  at most this many ids in all
-- ARGV[3..] deadline indexes (sorted sets of session id -> deadline in ms)
--
-- Returns the ids whose deadline is at or before now, index by index in ARGV order.
--
-- Each index is first asked how many are due (ZCOUNT, about 30% cheaper than a ZRANGE that
-- finds nothing, and most find nothing); only those with some are read.
local now, due, budget = ARGV[1], {}, tonumber(ARGV[2])
for i = 3, #ARGV do
  if budget <= 0 then
    break
  end
  if redis.call('ZCOUNT', ARGV[i], '-inf', now) > 0 then
    local ids = redis.call('ZRANGE', ARGV[i], '-inf', now, 'BYSCORE', 'LIMIT', 0, budget)
    for j = 1, #ids do
      due[#due + 1] = ids[j]
    end
    budget = budget - #ids
  end
end
return due
