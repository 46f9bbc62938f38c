-- A broken settle.lua, for tests/history only: the rule before issue 31, on today's keys.
-- A settled request removes every entry of its session whose seq is at or below its own,
-- not only its own entry: settling a save then removes a delete stamped alike (hole 2).
-- The history check must find that (test_histories.py). KEYS and ARGV as settle.lua's.
local settled = #ARGV / 2
for i = 1, settled do
  local id, req = ARGV[2 * i - 1], ARGV[2 * i]
  local entries, legacy = KEYS[2 * i], KEYS[2 * i + 1]
  local own = redis.call('HGET', entries, req)
  if own then
    local seq = tonumber(string.match(own, '^(%d+)'))
    local flat = redis.call('HGETALL', entries)
    for j = 1, #flat, 2 do
      if tonumber(string.match(flat[j + 1], '^(%d+)')) <= seq then
        redis.call('HDEL', entries, flat[j])
      end
    end
  end
  if redis.call('EXISTS', entries, legacy) == 0 then
    redis.call('ZREM', KEYS[1], id)
  end
end
for i = 2 + 2 * settled, #KEYS do
  redis.call('DEL', KEYS[i])
end
return 0
