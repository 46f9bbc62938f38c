-- load.lua: read a session's checkpoint and its fence in one round trip.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
--
-- Returns {value, seq, deleted, req, deadline, now}, each nil (false) where absent; now is the
-- server's time (ms) at the read. Read together, the fence is never older than the value,
-- so a request stamped after the fence's seq sorts after the write that was loaded (the
-- producer rule, docs/protocol.md). A producer merging a pending entry read from a broker
-- of its own judges whether that entry's save is past its deadline by this time, the store
-- read's, never by its own clock: between its two reads a newer fence may have expired.
local fence = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req', 'deadline')
local time = redis.call('TIME')
return {redis.call('GET', KEYS[1]), fence[1], fence[2], fence[3], fence[4],
  tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)}
