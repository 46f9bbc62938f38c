-- The same fields of many hashes in one call: what List reads of the pending records
-- (on the broker) and of their sessions' fences (on the store; on a cluster, one slot's
-- keys per call).
--
-- KEYS     the hashes
-- ARGV     the fields
--
-- Returns, for each key in order, each field's value (nil where absent): #KEYS * #ARGV
-- items. Read-only.
local out = {}
for i = 1, #KEYS do
  local values = redis.call('HMGET', KEYS[i], unpack(ARGV))
  for j = 1, #ARGV do
    out[#out + 1] = values[j]
  end
end
return out
