#!lua flags=no-writes,allow-cross-slot-keys
-- due.lua: the due sessions of many deadline indexes of one Redis Cluster node, in one call,
-- and each index's earliest deadline (what the sweep hint records: see RedisStore).
--
-- The one script whose keys come in ARGV: it reads the indexes of many slots, and Redis
-- Cluster refuses a command whose declared KEYS span slots before any script flag is looked
-- at. So it is sent to a node directly (never routed by key), and every index named must be
-- in a slot that node serves: Redis refuses the call otherwise ('non local key'), and the
-- caller regroups the slots by node. Read-only.
--
-- ARGV[1]  now in ms since epoch
-- ARGV[2]  at most this many ids in all
-- ARGV[3..] deadline indexes (sorted sets of session id -> deadline in ms)
--
-- Returns {earliest, ids}: earliest[i] is the smallest deadline in the i-th index named
-- ('' when it is empty), for the indexes read, in ARGV order (fewer than named once the id
-- budget is spent: the rest were not read); ids are those whose deadline is at or before
-- now, index by index. An index holding due ids reports an earliest deadline at or before
-- now, so the caller keeps it due until a later call finds it clear.
--
-- Each index costs one ZRANGE 0 0 (its smallest deadline) when nothing in it is due, as
-- cheap as the ZCOUNT it replaces; only those with some due are read further.
local now, earliest, due, budget = tonumber(ARGV[1]), {}, {}, tonumber(ARGV[2])
for i = 3, #ARGV do
  if budget <= 0 then
    break
  end
  local first = redis.call('ZRANGE', ARGV[i], 0, 0, 'WITHSCORES')
  if #first == 0 then
    earliest[#earliest + 1] = ''
  else
    earliest[#earliest + 1] = first[2]
    if tonumber(first[2]) <= now then
      local ids = redis.call('ZRANGE', ARGV[i], '-inf', now, 'BYSCORE', 'LIMIT', 0, budget)
      for j = 1, #ids do
        due[#due + 1] = ids[j]
      end
      budget = budget - #ids
    end
  end
end
return {earliest, due}
