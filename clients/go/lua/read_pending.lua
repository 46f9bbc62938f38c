-- Read a session's pending record and the broker's epoch (the broker side of a load when
-- the store is another Redis; docs/protocol.md, "Pending records").
--
-- KEYS[1]  the pending record (<prefix>.cq:pending:<id>)
-- KEYS[2]  the pending epoch (<prefix>.cq:pending-epoch)
--
-- Returns {seq, op, req, value, epoch}, each nil (false) where absent. Read-only.
local record = redis.call('HMGET', KEYS[1], 'seq', 'op', 'req', 'value')
return {record[1], record[2], record[3], record[4], redis.call('GET', KEYS[2])}
