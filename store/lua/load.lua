-- load.lua: read a session's checkpoint and its fence in one round trip.
--
-- KEYS[1]  data key
-- KEYS[2]  fence hash (see save.lua)
--
-- Returns {value, seq, deleted, req, deadline}, each nil (false) where absent. Read together, the
-- fence is never older than the value, so a request stamped after the fence's seq sorts
-- after the write that was loaded (the producer rule, docs/protocol.md).
local fence = redis.call('HMGET', KEYS[2], 'seq', 'deleted', 'req', 'deadline')
return {redis.call('GET', KEYS[1]), fence[1], fence[2], fence[3], fence[4]}
