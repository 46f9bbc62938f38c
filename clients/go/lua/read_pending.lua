-- Read a session's pending record and the broker's epoch (the broker side of a load when
-- the store is another Redis; docs/protocol.md, "Pending records"). clients/go/lua/
-- read_pending.lua is the Go client's copy.
--
-- KEYS[1]  the pending record (<prefix>.cq:pending:<id>)
-- KEYS[2]  the pending epoch (<prefix>.cq:pending-epoch)
--
-- Returns {seq, op, req, value, epoch}, each nil (false) where absent. Read-only. A staged
-- save's record names its value's key (docs/protocol.md, "Staged saves"), read here in the
-- value's place: a key the record names, not KEYS, which a single Redis allows (pending
-- records are never on a cluster).
local record = redis.call('HMGET', KEYS[1], 'seq', 'op', 'req', 'value', 'staged')
if record[5] then
  record[4] = redis.call('GET', record[5])
end
return {record[1], record[2], record[3], record[4], redis.call('GET', KEYS[2])}
