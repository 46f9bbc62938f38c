-- A load when the broker and the store are one Redis: the session's pending record and
-- the broker's pending epoch, then its stored value and fence (as store/lua/load.lua reads
-- them), in one call (docs/protocol.md, "Pending records"). clients/go/lua/load_pending.lua
-- is the Go client's copy.
--
-- KEYS[1]  the pending record (<prefix>.cq:pending:<id>)
-- KEYS[2]  the pending epoch (<prefix>.cq:pending-epoch)
-- KEYS[3]  the data key
-- KEYS[4]  the fence hash
--
-- Returns {record seq, op, req, value, epoch, stored value, fence seq, deleted, req,
-- deadline}, each nil (false) where absent. Read-only. A staged save's record names its
-- value's key (docs/protocol.md, "Staged saves"), read here in the value's place: a key the
-- record names, not KEYS, which a single Redis allows (pending records are never on a
-- cluster).
local record = redis.call('HMGET', KEYS[1], 'seq', 'op', 'req', 'value', 'staged')
if record[5] then
  record[4] = redis.call('GET', record[5])
end
local epoch = redis.call('GET', KEYS[2])
local fence = redis.call('HMGET', KEYS[4], 'seq', 'deleted', 'req', 'deadline')
return {record[1], record[2], record[3], record[4], epoch,
  redis.call('GET', KEYS[3]), fence[1], fence[2], fence[3], fence[4]}
