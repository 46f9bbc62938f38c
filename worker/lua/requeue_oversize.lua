-- requeue_oversize.lua: put a kept oversize item back at the far end of its queue.
--
-- The item moves inside the broker (one copy, into the list), never to the caller: it may
-- be hundreds of MB.
--
-- KEYS[1]  the kept item (a string key, worker/oversize.py)
-- KEYS[2]  the index of kept items (sorted set of their keys)
-- KEYS[3]  the queue list it came from
--
-- Returns 1 when it moved, 0 when no such item is kept.
local item = redis.call('GET', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
if not item then return 0 end
redis.call('LPUSH', KEYS[3], item)
redis.call('DEL', KEYS[1])
item = nil
collectgarbage('collect')
return 1
