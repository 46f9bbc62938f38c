-- A broken settle.lua, for tests/history only: the rule before issue 31, on today's keys.
-- A settled request removes every entry of its session whose seq is at or below its own,
-- not only its own entry: settling a save then removes a delete stamped alike (hole 2).
-- The history check must find that (test_histories.py). KEYS and ARGV as settle.lua's.
local settled = #ARGV / 6
for i = 1, settled do
  local a, k = 6 * (i - 1), 2 + 5 * (i - 1)
  local id, req, values = ARGV[a + 1], ARGV[a + 2], ARGV[a + 5]
  local entries, legacy = KEYS[k + 1], KEYS[k + 2]
  local own = redis.call('HGET', entries, req)
  if own then
    local seq = tonumber(string.match(own, '^(%d+)'))
    local flat = redis.call('HGETALL', entries)
    for j = 1, #flat, 2 do
      if tonumber(string.match(flat[j + 1], '^(%d+)')) <= seq then
        redis.call('HDEL', entries, flat[j])
        redis.call('HINCRBY', KEYS[2], id, -1) -- counted, so loads take it as settled
      end
    end
  end
  if redis.call('EXISTS', entries, legacy) == 0 then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  end
  if values ~= '0' then
    redis.call('DEL', KEYS[k + 3])
    if values == '2' then
      redis.call('DEL', KEYS[k + 4])
    end
  end
end
return 0
